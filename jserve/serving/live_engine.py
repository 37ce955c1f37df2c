"""``EngineClient`` over the live ``LLMEngine``: the one module of the serving layer that
reads the engine's scheduler, allocator, predictor and config, so a change inside the engine
changes this adapter and nothing at the edge.

The engine thread is ``EngineLoop``'s, driving ``LLMEngine``'s step API; this adds what only
the live engine can say: its model info, intake (``LLMEngine.prepare``: the offline API's own
checks), counters, its grammar and speculation counters for the metrics, and the routing
reports (``jserve.routing.replica``, the functions the simulator's cluster mode calls too).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Sequence

from jserve.lora.config import LoRARequest
from jserve.routing.load import PrefillTable, ReplicaLoad
from jserve.routing.replica import cached_tokens, prefill_table, replica_load
from jserve.sampling.params import SamplingParams
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.scheduler.predictor import RuntimePredictor
from jserve.serving.engine_api import EngineInfo, Prepared, decode_ids
from jserve.serving.engine_loop import EngineCounters, EngineLoop
from jserve.serving.metrics import LoRAState, ServerMetrics

if TYPE_CHECKING:
    from jserve.cache.allocator import PageAllocator
    from jserve.engine.engine import LLMEngine
    from jserve.tokenizer import Tokenizer


def lone_decode_s(predictor: RuntimePredictor | None) -> float:
    """The predicted time of a step with one decode (0 without a predictor): no request can
    be promised a shorter time per token."""
    return 0.0 if predictor is None else predictor.predict(
        BatchPlan((ScheduledChunk("", 0, 1, True),), ()))


def isolated_prefill(scheduler) -> Callable[[int], float]:
    """T(n), a prompt's isolated prefill time, from the deadline policies' own cache (0 for
    the policies without one)."""
    cache = getattr(scheduler, "cache", None)
    return (lambda n: cache.remaining(n, 0)) if cache is not None else (lambda n: 0.0)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What ``jserve serve`` builds its engine from: the model and the engine arguments
    (plain data, so an engine core in its own process builds the same one)."""

    model: str
    dtype: str = "auto"           # ``--dtype``; ``auto`` is resolved where JAX runs
    llm_kwargs: dict = dataclasses.field(default_factory=dict)  # the rest of ``LLM(...)``
    max_waiting: int = 1024
    log_level: str = "INFO"


def build_engine(spec: EngineSpec) -> LLMEngine:
    """``spec``'s engine: how ``jserve serve`` builds it, in this process or in the engine
    core's own (``core_process``)."""
    from jserve import LLM
    from jserve.model.weights import resolve_dtype

    dtype, why = resolve_dtype(spec.model, spec.dtype)  # starts JAX
    engine = LLM(spec.model, dtype=dtype, **spec.llm_kwargs).engine
    engine.startup.dtype_reason = why if spec.dtype == "auto" else "--dtype"
    return engine


class LiveEngine(EngineLoop):
    """Owns ``engine`` from ``start()`` until ``shutdown()`` returns."""

    def __init__(self, engine: LLMEngine, *, max_waiting: int = 1024,
                 idle_poll_s: float = 1.0):
        super().__init__(engine, max_waiting=max_waiting, idle_poll_s=idle_poll_s)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        cfg, alloc = engine.config, engine.allocator
        lora = cfg.lora if engine.adapters is not None else None
        # Imported here, as ``estimated_predictor`` below: the engine package loads JAX, which
        # a server on a fake engine never does (a live engine has long before).
        from jserve.engine.device import kv_transfer
        self._kv = kv_transfer
        self.info = EngineInfo(
            vocab_size=engine.model_config.vocab_size, max_model_len=engine.max_model_len,
            eos_token_ids=tuple(engine.eos_ids), has_tokenizer=engine.tokenizer is not None,
            scheduler=cfg.scheduler, page_size=cfg.page_size, num_kv_pages=alloc.total,
            max_num_seqs=cfg.max_num_seqs, prefix_caching=alloc.prefix_caching,
            lone_decode_s=lone_decode_s(engine.predictor),
            pooling=cfg.pooler_config if engine.pooler is not None else None,
            hidden_size=engine.model_config.hidden_size,
            num_labels=engine.model_config.num_labels,
            max_loras=lora.max_loras if lora else 0,
            max_lora_rank=lora.max_lora_rank if lora else 0,
            runtime_lora_updating=bool(lora and lora.runtime_updating),
            kv_transfer=kv_transfer.unsupported(engine),
            kv_bytes_per_token=kv_transfer.bytes_per_token(engine))
        self._isolated = isolated_prefill(engine.scheduler)
        self._table: PrefillTable | None = None
        self._predictor: RuntimePredictor | None = None  # with the table: the reports'

    # -- any thread ------------------------------------------------------------------------
    def prepare(self, prompt: str | Sequence[int], params: SamplingParams,
                adapter: str | None = None) -> Prepared:
        # (a LoRARequest without a path names a registered adapter: nothing is registered
        # here, off the engine thread)
        if adapter is None:
            return self.engine.prepare(prompt, params)
        return self.engine.prepare(prompt, params, LoRARequest(adapter))

    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool = True
                 ) -> list[int]:
        return list(self.engine.intake.tokenize(prompt, add_special_tokens)[1])

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return decode_ids(self.tokenizer, token_ids, self.info.vocab_size)

    def isolated_prefill_s(self, prompt_tokens: int) -> float:
        return self._isolated(prompt_tokens)

    def attach_metrics(self, metrics: ServerMetrics) -> None:
        super().attach_metrics(metrics)
        metrics.watch_grammars(self.engine.intake.grammars)
        metrics.watch_speculation(self.engine.speculator)
        if self.engine.kv_tier is not None:
            metrics.watch_kv_tier(lambda: self.engine.kv_tier.stats(self.engine.scheduler))

    # -- for an engine core in its own process (``core_process``) -------------------------
    def intake_parts(self) -> tuple[Tokenizer | None, tuple[int, ...], str | None,
                                    PageAllocator]:
        """What a ``RequestIntake`` elsewhere needs to refuse exactly what this engine's
        does: the tokenizer, the EOS ids, why prompt logprobs are refused (None: they are
        not) and an empty pool of this one's geometry."""
        eng = self.engine
        return (eng.tokenizer, tuple(eng.eos_ids), eng.intake.no_prompt_logprobs,
                eng.allocator.blank())

    def compile_grammar(self, prepared: Prepared) -> None:
        """Compiles ``prepared``'s grammar into the engine's cache (any thread): a request
        prepared in another process brings none."""
        so = prepared.params.structured_output
        if so is not None:
            try:
                self.engine.intake.grammars.check(so)
            except Exception:  # noqa: BLE001 - intake checked it; the add reports it
                pass

    def scrape(self) -> dict:
        """The counters ``attach_metrics`` reads at each scrape, as data (engine thread)."""
        eng = self.engine
        g = eng.intake.grammars
        return {"grammars": (g.compiles, g.hits),
                "speculation": eng.speculator.stats() if eng.speculator else None,
                "kv_tier": eng.kv_tier.stats(eng.scheduler) if eng.kv_tier else None}

    # -- engine thread ---------------------------------------------------------------------
    def _counters(self) -> EngineCounters:
        eng = self.engine
        sched, alloc = eng.scheduler, eng.allocator
        return EngineCounters(
            requests=len(eng.requests), waiting=len(sched.waiting), running=len(sched.running),
            pages_used=alloc.num_allocated, pages_free=alloc.num_free,
            pages_total=alloc.total, preemptions=sched.num_preemptions,
            prefix_queried=sched.prefix_queried_tokens, prefix_hits=sched.prefix_hit_tokens,
            cached_pages=alloc.num_cached)

    def _check(self) -> None:
        self.engine.allocator.check()

    def _adapter_registry(self) -> dict[str, str]:
        slots = self.engine.adapters
        return {} if slots is None else {n: r.lora_path for n, r in slots.known.items()}

    def _add_adapter(self, name: str, path: str) -> None:
        if self.engine.adapters is None:
            return super()._add_adapter(name, path)
        self.engine.adapters.add(LoRARequest(name, 0, path))

    def _remove_adapter(self, name: str) -> None:
        self.engine.adapters.remove(name)

    def _lora_state(self) -> LoRAState | None:
        slots = self.engine.adapters
        if slots is None:
            return None
        waiting = {r.adapter for r in self.engine.scheduler.waiting if r.adapter is not None}
        return LoRAState(tuple(slots.running()), tuple(sorted(waiting)), slots.loads,
                         slots.evictions)

    def _export_kv(self, token_ids: list[int], adapter: str | None) -> bytes:
        if self.info.kv_transfer is not None:
            return super()._export_kv(token_ids, adapter)
        return self._kv.export_pages(self.engine, token_ids, adapter)

    def _import_kv(self, token_ids: list[int], wire: bytes, adapter: str | None
                   ) -> tuple[int, int]:
        if self.info.kv_transfer is not None:
            return super()._import_kv(token_ids, wire, adapter)
        return self._kv.import_pages(self.engine, token_ids, wire, adapter)

    def _load(self, replica: str, now: float, healthy: bool) -> ReplicaLoad:
        if self._table is None:
            self._table = self._prefill_table()
        return replica_load(replica, self.engine.scheduler, self._table, now, healthy=healthy,
                            predictor=self._predictor)

    def _cached_tokens(self, prompt_ids: Sequence[int]) -> int:
        return cached_tokens(self.engine.scheduler, prompt_ids)

    def _prefill_table(self) -> PrefillTable:
        """The deadline policies' own prefill-time cache; for the others, one built from the
        engine's predictor (or its FLOP estimate) with the scheduler's token budget."""
        # Imported here: it imports JAX, which a server on a fake engine never loads (a live
        # engine has loaded it long before).
        from jserve.engine.loop.timing import estimated_predictor
        eng = self.engine
        self._predictor = predictor = eng.predictor or estimated_predictor(eng.model_config)
        cache = getattr(eng.scheduler, "cache", None)
        if cache is None:
            cache = PrefillTimeCache(predictor, eng.max_model_len, math.inf,
                                     max_chunk=eng.scheduler.token_budget)
        return prefill_table(cache, eng.max_model_len)

"""LLMEngine: iteration-level continuous batching on one device or a tp x kvp mesh.

Each ``step()`` asks the scheduler for a BatchPlan, runs one fused device step for it, and
turns sampled ids into per-request outputs (detokenize, stop checks, finish). Requests are
added and aborted between steps; every accepted request ends with a finish reason.
With ``spp > 1`` in the mesh each ``step()`` is one stream-pipeline tick instead (``_tick``;
docs/engine.md, "Stream pipeline parallelism").
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
import time
from typing import Sequence

import jax
import numpy as np

from jserve.cache.allocator import BlockAllocator
from jserve.cache.pool import allocate_kv_cache, kv_bytes_per_page, num_pages_for_budget
from jserve.config import LlamaConfig
from jserve.engine.buckets import Buckets
from jserve.engine.config import EngineConfig
from jserve.engine.output import (
    IncrementalDetokenizer,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
    find_stop,
)
from jserve.engine.plan import describe_engine
from jserve.engine.runner import CACHE_EVENTS, ModelRunner
from jserve.engine.step_builder import StepBuilder, StepFlags
from jserve.engine.timing import estimated_predictor, host_round_trip_seconds, load_predictor
from jserve.kernels import ATTENTION_IMPLS
from jserve.model.llama import Params
from jserve.probe.length_probe import LengthProbe
from jserve.probe.tracker import LengthTracker
from jserve.sampling.params import MAX_BANNED_IDS, SamplingParams
from jserve.sampling.sampler import SamplerRow
from jserve.scheduler import (
    POLICIES,
    BatchPlan,
    Request,
    RequestStatus,
    ScheduledChunk,
    build_scheduler,
)
from jserve.scheduler.deadline import DeadlineConfig
from jserve.tokenizer import Tokenizer
from sharding import distributed, pipeline
from sharding.mesh import MeshConfig, make_mesh
from sharding.specs import allocate_sharded_kv_cache, kv_head_map, kv_heads_per_device

log = logging.getLogger(__name__)

_NEUTRAL_ROW = SamplerRow(SamplingParams(temperature=0.0), seed=0, step=0)


@dataclasses.dataclass(eq=False)
class _Tracked:
    """Engine-side data of one request (the scheduler's Request.payload)."""

    params: SamplingParams
    seed: int
    prompt: str | None
    metrics: RequestMetrics
    detok: IncrementalDetokenizer
    prompt_ids: list[int]  # what outputs show: one copy per request, not one per step
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    state_row: int | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclasses.dataclass(eq=False)
class _Launch:
    """A batch in the pipeline: its chunks with their Request objects (an id may be reused
    once a request is aborted) and the rows it samples."""

    chunks: list[tuple[Request, ScheduledChunk]]
    sample_rows: list[tuple[int, ScheduledChunk]]
    want_logprobs: bool


_EMPTY_PLAN = BatchPlan((), ())


def enable_compilation_cache(path: str | None) -> None:
    """Persistent XLA cache: restarts and repeated test processes skip recompiling."""
    if path is None:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class LLMEngine:
    def __init__(self, cfg: LlamaConfig, params: Params, tokenizer: Tokenizer | None,
                 config: EngineConfig = EngineConfig()):
        started = time.perf_counter()
        if config.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, "
                             f"got {config.attention_impl!r}")
        if config.scheduler not in POLICIES:
            raise ValueError(f"scheduler must be one of {POLICIES}, got {config.scheduler!r}")
        enable_compilation_cache(config.compilation_cache_dir)
        mesh_config = MeshConfig.parse(config.mesh)
        if mesh_config.dp > 1:
            raise ValueError(f"mesh {config.mesh!r}: dp > 1 not supported yet (tensor, "
                             "KV-cache and stream pipeline parallelism, tp/kvp/spp=N, run)")
        mesh_config.validate(cfg)
        self._spp = mesh_config.spp
        if self._spp > 1:
            pipeline.validate(cfg, self._spp)
        self._multi_process = jax.process_count() > 1
        if self._multi_process and mesh_config.size != jax.device_count():
            raise ValueError(f"mesh {config.mesh!r}: with {jax.process_count()} processes it "
                             f"must cover all {jax.device_count()} devices")
        mesh = make_mesh(mesh_config) if mesh_config.size > 1 else None
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 8192)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}")
        budget = min(config.max_num_batched_tokens, self.max_model_len)
        self.buckets = Buckets.for_limits(
            max_num_seqs=config.max_num_seqs, token_budget=budget,
            max_prefill_seqs=config.max_prefill_seqs, max_model_len=self.max_model_len,
            page_size=config.page_size, kvp=mesh_config.kvp)
        if self._spp > 1:
            self.buckets = self.buckets.single_shape()
        # KV pool: one kvp group's pool per device (sized by the heads a device stores under
        # tp and the layers of its pipeline stage); a sequence keeps at most pages_per_group
        # pages in one group, and the groups' pools sit side by side in the cache's page
        # dimension (global id = group * pool + local id; jserve.cache.allocator).
        kvp, tp = mesh_config.kvp, mesh_config.tp
        pages_per_seq = (-(-self.max_model_len // config.page_size) if kvp == 1
                         else self.buckets.pages_per_group)
        num_pages = config.num_kv_pages or num_pages_for_budget(
            cfg, config.page_size, kv_cache_bytes=config.kv_cache_bytes,
            memory_fraction=config.memory_fraction,
            max_useful_pages=config.max_num_seqs * pages_per_seq,
            kv_heads=kv_heads_per_device(cfg, tp),
            num_layers=cfg.num_hidden_layers // self._spp)
        self.predictor = (load_predictor(cfg, config)
                          if config.scheduler not in ("sarathi", "sprpt") else None)
        self.length_tracker = self._length_tracker(cfg, config)
        prefix_caching = config.enable_prefix_caching and self._spp == 1 \
            and self.length_tracker is None
        if config.enable_prefix_caching and not prefix_caching:
            log.info("prefix caching is off: not supported with %s",
                     "spp > 1" if self._spp > 1 else "a length probe")
        self.allocator = BlockAllocator(num_pages, config.page_size, groups=kvp,
                                        pages_per_group=self.buckets.pages_per_group,
                                        prefix_caching=prefix_caching)
        probe = self.length_tracker.probe if self.length_tracker else None
        self.scheduler = build_scheduler(
            config.scheduler, self.allocator, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget, max_prefill_seqs=config.max_prefill_seqs,
            predictor=self.predictor, max_context=self.max_model_len,
            deadline=DeadlineConfig(t_target=config.tpot_slo, ttft_k=config.ttft_slo_factor,
                                    ttft_floor=config.ttft_slo_floor,
                                    space_sharing=config.space_sharing),
            sprpt_c=config.sprpt_c, fallback_remaining=probe.prior_mean if probe else None)
        # Swap-to-host preemption: host copies by request id and the bytes they reserve.
        self._cost_predictor = self.predictor or estimated_predictor(cfg)
        # A swapped page is a global page: every stored KV head (copies under tp included).
        self._page_bytes = kv_bytes_per_page(cfg, config.page_size, len(kv_head_map(cfg, tp)))
        self._host_kv: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._host_reserved: dict[str, int] = {}
        # Swapping moves pages through host memory of one process; across processes the
        # engine recomputes instead.
        if config.preemption != "recompute" and not self._multi_process and self._spp == 1:
            self.scheduler.choose_preemption = self._preemption_mode
        kv_cache = (allocate_kv_cache(cfg, num_pages, config.page_size) if mesh is None else
                    allocate_sharded_kv_cache(cfg, kvp * num_pages, config.page_size, mesh))
        # A lazy checkpoint (jserve.model.weights.LazyCheckpoint) streams onto the mesh.
        placed = hasattr(params, "place")
        if placed:
            params = params.place(cfg, mesh)
        self.runner = ModelRunner(cfg, params, kv_cache, self.buckets, config.max_num_seqs,
                                  config.attention_impl, mesh,
                                  capture_layer=self.length_tracker.layer
                                  if self.length_tracker else None, params_placed=placed,
                                  unroll_layers=config.unrolls_layers(
                                      cfg.num_hidden_layers, self._spp))
        self.builder = StepBuilder(self.buckets, config.page_size, self.runner.state_sink,
                                   pool_pages=num_pages)
        self._free_state_rows = list(range(self.runner.state_sink - 1, -1, -1))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        # The model's own EOS ids plus the tokenizer's (generation_config may add end-of-turn).
        self.eos_ids = tuple(dict.fromkeys(
            cfg.eos_token_ids + (tokenizer.eos_token_ids if tokenizer else ())))
        self.step_log: list[tuple[BatchPlan, float]] | None = None  # (plan, seconds) when on
        if config.warmup:
            hits = CACHE_EVENTS["cache_hits"]
            self.runner.warmup()
            hits = CACHE_EVENTS["cache_hits"] - hits
        else:
            hits = None
        # Stream pipeline: the batches in the stages (newest first; None: an empty slot) and,
        # when on, one record per tick for tests (see ``_tick``).
        self._pipeline: collections.deque[_Launch | None] = collections.deque()
        self.pipeline_log: list[dict] | None = None
        if self._spp > 1:
            self._empty = self.builder.build(_EMPTY_PLAN, self.requests, self._sampler_row,
                                             _NEUTRAL_ROW, lambda r: r.payload.state_row,
                                             StepFlags(False, False, False))
            self.runner.start_pipeline(self._empty.shape, self._empty.arrays)
        self.startup_summary = (
            f"engine ready in {time.perf_counter() - started:.1f}s: {describe_engine(self)}; "
            f"compiled {self.runner.compile_count} programs in "
            f"{self.runner.compile_seconds:.1f}s"
            + (f" ({hits} from the persistent cache)" if hits is not None else
               " (warmup off: step shapes compile on first use)")
            + f"; prefix caching {'on' if self.allocator.prefix_caching else 'off'}")
        log.info("%s", self.startup_summary)

    @staticmethod
    def _length_tracker(cfg: LlamaConfig, config: EngineConfig) -> LengthTracker | None:
        """The probe's tracker when a probe or a capture layer is set (sprpt needs a probe)."""
        probe = LengthProbe.load(config.length_probe) if config.length_probe else None
        if probe is not None:
            if probe.input_dim != cfg.hidden_size:
                raise ValueError(f"length probe reads {probe.input_dim}-wide embeddings; the "
                                 f"model's hidden size is {cfg.hidden_size}")
            if config.probe_layer is not None and config.probe_layer != probe.layer:
                raise ValueError(f"probe_layer {config.probe_layer} differs from the probe's "
                                 f"layer {probe.layer}")
        elif config.scheduler == "sprpt":
            raise ValueError("scheduler 'sprpt' needs a length probe (length_probe=path)")
        layer = probe.layer if probe is not None else config.probe_layer
        if layer is None:
            return None
        if layer >= cfg.num_hidden_layers:
            raise ValueError(f"probe layer {layer} is past the model's {cfg.num_hidden_layers} "
                             "layers")
        return LengthTracker(probe, layer)

    # -- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {self.cfg.vocab_size}): "
                             f"{bad[:5]}")
        return None, ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Every check that could refuse a request, before any state changes."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate(vocab_size=self.cfg.vocab_size)
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; the context holds {self.max_model_len}")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"context of {self.max_model_len} tokens")
        need = self.allocator.blocks_for(n + params.max_tokens)
        if not self.allocator.can_ever_hold(need):
            raise ValueError(f"request needs {need} KV blocks; the pool has {self.allocator.total}"
                             + (f" ({self.allocator.groups} groups of "
                                f"{self.allocator.pool_blocks - 1})"
                                if self.allocator.groups > 1 else ""))

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    ttft_slo: float | None = None, tpot_slo: float | None = None,
                    priority: int = 0) -> str:
        """``ttft_slo`` (seconds after arrival) overrides the policy's default TTFT deadline;
        ``tpot_slo`` caps the iteration budget while the request runs; a lower ``priority``
        goes first under deadline-aware policies."""
        params = params if params is not None else SamplingParams()
        text, ids = self.tokenize(prompt)
        self.validate(ids, params)
        for name, slo in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo)):
            if slo is not None and not slo > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {slo}")
        return self._enqueue(text, ids, params, request_id, arrival_time, ttft_slo, tpot_slo,
                             int(priority))

    def add_requests(self, prompts: Sequence[str | Sequence[int]],
                     params: Sequence[SamplingParams]) -> list[str]:
        """All or nothing: every prompt is tokenized and validated (once) before any is
        queued, so a bad one raises ValueError naming its index and leaves the engine as it
        was."""
        prepared = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            try:
                text, ids = self.tokenize(prompt)
                self.validate(ids, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            prepared.append((text, ids, p))
        return [self._enqueue(text, ids, p) for text, ids, p in prepared]

    def _enqueue(self, text: str | None, ids: list[int], params: SamplingParams,
                 request_id: str | None = None, arrival_time: float | None = None,
                 ttft_slo: float | None = None, tpot_slo: float | None = None,
                 priority: int = 0) -> str:
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        tracked = _Tracked(
            params=params,
            seed=params.seed if params.seed is not None else self._rng.getrandbits(32),
            prompt=text,
            metrics=RequestMetrics(time.monotonic() if arrival_time is None else arrival_time),
            detok=IncrementalDetokenizer(self.tokenizer),
            prompt_ids=list(ids),
            logprobs=[] if params.logprobs is not None else None)
        req = Request(rid, ids, params.max_tokens, tracked.metrics.arrival_time, payload=tracked,
                      tpot_slo=tpot_slo, priority=priority,
                      cacheable=not params.uses_penalties)  # penalties count every token
        if ttft_slo is not None:
            req.ttft_deadline = req.arrival_time + ttft_slo
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort between steps; blocks are freed at once. None if the id is unknown or done."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (
            self._spp > 1 and any(b is not None for b in self._pipeline))

    @property
    def compile_count(self) -> int:
        return self.runner.compile_count

    # -- one iteration -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._spp > 1:
            return self._tick()
        plan = self.scheduler.schedule()
        for rid, pages in plan.swap_out:  # before anything can overwrite the freed pages
            self._host_kv[rid] = self.runner.read_pages(pages)
        for rid in plan.preempted:
            self._release_state_row(self.requests[rid])
        for rid, pages in plan.swap_in:
            self.runner.write_pages(pages, self._host_kv.pop(rid))
            del self._host_reserved[rid]
        if plan.is_empty:
            return []
        chunks, flags = self._prepare(plan)
        try:
            built = self.builder.build(plan, self.requests, self._sampler_row, _NEUTRAL_ROW,
                                       lambda r: r.payload.state_row, flags)
            t0 = time.perf_counter()
            # Multi-process: the leader broadcasts each step so followers launch it too.
            out = (distributed.leader_execute(self.runner, built.shape, built.arrays)
                   if self._multi_process else self.runner.execute(built.shape, built.arrays))
            tokens = np.asarray(out.tokens)
            if self.step_log is not None:
                self.step_log.append((plan, time.perf_counter() - t0))
            logprobs = (tuple(map(np.asarray, (out.logprobs, out.top_ids, out.top_logprobs)))
                        if flags.want_logprobs else None)
        except Exception as e:  # noqa: BLE001 - a failed step must not strand its requests
            log.exception("engine step failed; failing its %d requests",
                          len(chunks))
            return [self._finish(self.requests[c.request_id], RequestStatus.FINISHED_ABORTED,
                                 error=f"engine step failed: {e}")
                    for c in chunks]
        for c in chunks:
            self.scheduler.advance(self.requests[c.request_id], c.num_tokens)
        if self.length_tracker is not None:
            self.length_tracker.observe(plan, built, self.requests, self.runner.last_capture)
        return self._sampled_outputs(built.sample_rows, self.requests, tokens, logprobs)

    def _prepare(self, plan: BatchPlan) -> tuple[tuple[ScheduledChunk, ...], StepFlags]:
        """Hands state rows to the plan's requests, stamps first-scheduled times and sets the
        step's run-time switches."""
        now = time.monotonic()
        chunks = plan.decodes + plan.prefills
        for c in chunks:
            req = self.requests[c.request_id]
            tr: _Tracked = req.payload
            if tr.state_row is None:
                tr.state_row = self._free_state_rows.pop()
            if tr.metrics.first_scheduled_time is None:
                tr.metrics.first_scheduled_time = now
        params = [self.requests[c.request_id].payload.params for c in chunks]
        sampled = [p for c, p in zip(chunks, params) if c.samples]
        flags = StepFlags(any_random=any(p.temperature > 0 for p in sampled),
                          # Every chunk of a penalised request counts: its prompt tokens
                          # fill the penalty state.
                          any_penalty=any(p.uses_penalties for p in params),
                          want_logprobs=any(p.logprobs is not None for p in sampled))
        return chunks, flags

    def _sampled_outputs(self, sample_rows, requests: dict[str, Request], tokens: np.ndarray,
                         logprobs: tuple[np.ndarray, ...] | None) -> list[RequestOutput]:
        """Appends each sampled row's token to its request (``requests``: by id)."""
        now = time.monotonic()
        outputs = []
        for row, c in sample_rows:
            req = requests[c.request_id]
            tr: _Tracked = req.payload
            tok = int(tokens[row])
            if tr.logprobs is not None:
                chosen, top_ids, top_lp = logprobs
                n = tr.params.logprobs
                tr.logprobs.append(TokenLogprob(tok, float(chosen[row]), tuple(
                    zip(top_ids[row, :n].tolist(), top_lp[row, :n].tolist()))))
            outputs.append(self._append_token(req, tok, now))
        return outputs

    # -- stream pipeline parallelism (spp > 1) -------------------------------------------
    def _tick(self) -> list[RequestOutput]:
        """One pipeline tick: a new batch (or, while batches are in flight and nothing is
        schedulable, an empty one) enters stage 0; returns the outputs of the batch that left
        the last stage. Every chunk advances ``num_computed`` at launch, so the next chunk of
        a prefill can follow one tick behind; requests with a sampled token in flight are
        held, and every request with a chunk in flight is pinned (never preempted, blocks
        freed only once its chunks are out)."""
        sched = self.scheduler
        plan = sched.schedule() if sched.has_schedulable() else _EMPTY_PLAN
        for rid in plan.preempted:
            self._release_state_row(self.requests[rid])
        if plan.is_empty and not any(b is not None for b in self._pipeline):
            return []
        launch, built = None, self._empty
        if not plan.is_empty:
            chunks, flags = self._prepare(plan)
            try:
                built = self.builder.build(plan, self.requests, self._sampler_row, _NEUTRAL_ROW,
                                           lambda r: r.payload.state_row, flags)
            except Exception as e:  # noqa: BLE001
                log.exception("building a pipeline batch failed; failing its requests")
                return [self._finish(self.requests[c.request_id], RequestStatus.FINISHED_ABORTED,
                                     error=f"engine step failed: {e}") for c in chunks]
            launch = _Launch([(self.requests[c.request_id], c) for c in chunks],
                             built.sample_rows, flags.want_logprobs)
        try:
            t0 = time.perf_counter()
            # Multi-process: followers replay every tick, empty ones included.
            out = (distributed.leader_execute(self.runner, built.shape, built.arrays)
                   if self._multi_process else self.runner.execute(built.shape, built.arrays))
            tokens = np.asarray(out.tokens)
            if self.step_log is not None and launch is not None:
                self.step_log.append((plan, time.perf_counter() - t0))  # one tick's time
        except Exception as e:  # noqa: BLE001 - a failed tick must not strand its requests
            log.exception("pipeline tick failed; failing every request in flight")
            return self._fail_pipeline(launch, e)
        if launch is not None:
            for req, c in launch.chunks:
                sched.advance(req, c.num_tokens)
            sched.pin([req for req, _ in launch.chunks])
            sched.hold([req for req, c in launch.chunks if c.samples])
        self._pipeline.appendleft(launch)
        if self.pipeline_log is not None:
            self.pipeline_log.append({
                "in_flight": sum(b is not None for b in self._pipeline),
                "stages": [[(req.request_id, c.start, c.num_tokens, c.samples)
                            for req, c in b.chunks]
                           if b is not None else [] for b in self._pipeline]})
        if len(self._pipeline) < self._spp:
            return []
        exiting = self._pipeline.pop()
        if exiting is None:
            return []
        for req, c in exiting.chunks:
            sched.unpin(req)
            if c.samples:
                sched.release(req)
        # Aborted while in flight (ids may even be reused): their sampled rows are dropped.
        live = {c.request_id: req for req, c in exiting.chunks
                if self.requests.get(c.request_id) is req}
        rows = [(row, c) for row, c in exiting.sample_rows if c.request_id in live]
        logprobs = (tuple(map(np.asarray, (out.logprobs, out.top_ids, out.top_logprobs)))
                    if exiting.want_logprobs else None)
        return self._sampled_outputs(rows, live, tokens, logprobs)

    def _fail_pipeline(self, launch: _Launch | None, error: Exception) -> list[RequestOutput]:
        """Fails the new batch's requests and every request with a chunk in flight, and
        empties the pipeline."""
        batches = [b for b in [launch, *self._pipeline] if b is not None]
        self._pipeline.clear()
        for req, _ in [rc for b in batches if b is not launch for rc in b.chunks]:
            self.scheduler.unpin(req)
        outputs, seen = [], set()
        for req, c in [rc for b in batches for rc in b.chunks]:
            if req in seen or self.requests.get(c.request_id) is not req:
                continue
            seen.add(req)
            outputs.append(self._finish(req, RequestStatus.FINISHED_ABORTED,
                                        error=f"engine step failed: {error}"))
        self.runner.start_pipeline(self._empty.shape, self._empty.arrays)
        return outputs

    def _preemption_mode(self, req: Request) -> str:
        """Swap when the host copy there and back is predicted cheaper than recomputing the
        KV and fits the swap space. Penalised requests recompute: their penalty state is
        rebuilt from the tokens a recompute feeds through again."""
        tr: _Tracked = req.payload
        if tr.params.uses_penalties:
            return "recompute"
        nbytes = self.allocator.blocks_for(req.num_computed) * self._page_bytes
        if sum(self._host_reserved.values()) + nbytes > self.config.swap_space_bytes:
            return "recompute"
        if self.config.preemption == "auto":
            recompute = self._cost_predictor.predict(BatchPlan((), (ScheduledChunk(
                req.request_id, 0, req.num_computed, False),)))
            if host_round_trip_seconds(nbytes) >= recompute:
                return "recompute"
        self._host_reserved[req.request_id] = nbytes
        return "swap"

    def _sampler_row(self, req: Request) -> SamplerRow:
        tr: _Tracked = req.payload
        p = tr.params
        banned: tuple[int, ...] = ()
        if req.num_output_tokens < p.min_tokens:
            banned = (p.stop_token_ids + (() if p.ignore_eos else self.eos_ids))[:MAX_BANNED_IDS]
        return SamplerRow(p, tr.seed, req.num_output_tokens, banned)

    def _append_token(self, req: Request, tok: int, now: float) -> RequestOutput:
        tr: _Tracked = req.payload
        p = tr.params
        req.token_ids.append(tok)
        m = tr.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        n_out = req.num_output_tokens
        status = None
        if tok in p.stop_token_ids or (tok in self.eos_ids and not p.ignore_eos):
            status = RequestStatus.FINISHED_STOPPED
            tr.text += tr.detok.flush()
        else:
            before = len(tr.text)
            tr.text += tr.detok.add(tok)
            cut = find_stop(tr.text, before, p.stop) if n_out >= p.min_tokens else None
            if cut is not None:
                tr.text = tr.text[:cut]
                status = RequestStatus.FINISHED_STOPPED
        if status is None and (n_out >= p.max_tokens or len(req.token_ids) >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
            tr.text += tr.detok.flush()
        if status is not None:
            return self._finish(req, status)
        return self._output(req)

    def _finish(self, req: Request, status: RequestStatus, error: str | None = None
                ) -> RequestOutput:
        tr: _Tracked = req.payload
        self.scheduler.finish(req, status)
        self._release_state_row(req)
        if self.length_tracker is not None:
            self.length_tracker.forget(req.request_id)
        self._host_kv.pop(req.request_id, None)
        self._host_reserved.pop(req.request_id, None)
        tr.finish_reason = status.value
        tr.error = error
        tr.metrics.finished_time = time.monotonic()
        tr.metrics.cached_tokens = req.num_cached_tokens
        del self.requests[req.request_id]
        return self._output(req)

    def _release_state_row(self, req: Request) -> None:
        tr: _Tracked = req.payload
        if tr.state_row is not None:
            self._free_state_rows.append(tr.state_row)
            tr.state_row = None

    def _output(self, req: Request) -> RequestOutput:
        tr: _Tracked = req.payload
        return RequestOutput(
            request_id=req.request_id, prompt=tr.prompt,
            prompt_token_ids=tr.prompt_ids, token_ids=req.output_token_ids,
            text=tr.text, finished=tr.finish_reason is not None, finish_reason=tr.finish_reason,
            metrics=tr.metrics, logprobs=list(tr.logprobs) if tr.logprobs is not None else None,
            error=tr.error)

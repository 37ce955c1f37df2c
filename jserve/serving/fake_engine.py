"""``FakeEngine``: an ``EngineClient`` with scripted tokens and step times and injectable faults,
for testing an edge (jserve's gateway, gRPC and HTTP front ends, router endpoints, or your
own) without a model: nothing compiles, and importing this module imports no JAX.

The real ``EngineLoop`` runs it (the engine thread, streams, stop-string holdback, deadlines,
the admission queue, metrics, per-request fault isolation); only the core under it is fake:
- tokens: ``script(prompt_ids, params, i)`` is the ``i``-th generated token; by default
  bytes of ``TEXT`` from an offset set by the prompt (and by the seed when sampling at a
  temperature), so the same request always gives the same text. Stop strings, stop token
  ids, EOS (unless ``ignore_eos``), ``min_tokens``, ``max_tokens`` (0: the prompt scored
  alone), the context length, logprobs and prompt logprobs (values and alternatives made
  up) apply as in the engine; other sampling fields are validated, not applied, and a
  structured output's grammar is compiled (so its errors are the engine's) but not
  enforced.
- time: each step sleeps ``step_s`` seconds and gives every running request one token; a
  request is admitted (first-come first-served, at most ``max_num_seqs`` running) with KV
  pages for its prompt and ``max_tokens``, and gets its first token in that step.
- the prefix cache: a prompt's full pages are remembered (up to ``num_kv_pages`` pages) and
  a later prompt starting with them reports them cached, in the counters and the routing
  reports.
- LoRA (``lora``, a ``LoRAConfig``): a plain registry of adapters by name and path (a
  path must be a directory; nothing is read from it), ``lora.modules`` registered at start;
  a request naming an adapter gets the script's tokens from an offset set by the name, so
  each adapter (and the base model) writes its own text. No slots: any number of adapters
  run in one step, and nothing is copied (the loads and evictions stay 0).
- faults: ``fail_steps(error)`` makes the next steps raise (an ``Exception`` fails that
  step's requests; a ``BaseException`` kills the engine thread), ``fail_requests(pick)``
  ends the requests ``pick`` chooses with an engine error after their first token.
``received`` records each request as the core received it (ids, SLO fields, priority).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import random
import time
from typing import Callable, Sequence

from jserve.cache.allocator import PageAllocator
from jserve.engine.requests.intake import PreparedRequest, RequestIntake
from jserve.engine.requests.output import (
    RequestMetrics,
    RequestOutput,
    StopText,
    TokenLogprob,
)
from jserve.fields import FieldError
from jserve.lora.config import LoRAConfig
from jserve.routing.load import FIFO, PrefillTable, QueuedPrefill, ReplicaLoad
from jserve.sampling.params import SamplingParams
from jserve.serving.engine_api import EngineInfo, decode_ids
from jserve.serving.engine_loop import EngineCounters, EngineLoop
from jserve.serving.metrics import LoRAState, ServerMetrics
from jserve.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. "
Script = Callable[[Sequence[int], SamplingParams, int], int]


def text_script(prompt_ids: Sequence[int], params: SamplingParams, i: int) -> int:
    """The default script: ``TEXT``'s bytes in a loop from an offset set by the prompt (and
    the seed at a temperature above 0)."""
    offset = sum(prompt_ids) + (params.seed or 0) * (params.temperature > 0)
    return TEXT.encode()[(offset + i) % len(TEXT)]


class FakeAdapters:
    """The fake's LoRA registry: name -> path (what the intake checks a request's adapter
    against; changed on the engine thread only)."""

    def __init__(self, modules: Sequence[tuple[str, str]] = ()):
        self.known: dict[str, str] = dict(modules)

    def check(self, name: str) -> None:
        if name not in self.known:
            raise FieldError("model", f"no adapter {name!r} is loaded "
                                      f"(loaded: {sorted(self.known)})")


def adapter_offset(adapter: str | None) -> int:
    """How far a request of ``adapter`` starts into the script (0: the base model)."""
    return 0 if adapter is None else sum(adapter.encode())


@dataclasses.dataclass(eq=False)
class FakeRequest:
    """One request as the fake core holds it."""

    request_id: str
    prepared: PreparedRequest
    arrival_time: float
    ttft_slo: float | None
    tpot_slo: float | None
    priority: int
    out: StopText  # the text so far and its stop
    metrics: RequestMetrics
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    pages_held: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def output(self) -> RequestOutput:
        p = self.prepared
        return RequestOutput(self.request_id, p.prompt, p.prompt_ids, self.out.text,
                             self.finish_reason is not None, self.finish_reason, self.metrics,
                             len(self.ids), self.error, self.ids, self.logprobs,
                             prompt_logprobs=self.prompt_logprobs,
                             stop_reason=self.out.stop_reason)


class _Core:
    """The engine thread's side: ``LLMEngine``'s step API over scripted requests."""

    def __init__(self, fake: FakeEngine, live: bool = True):
        self.fake = fake
        self.live = live  # False: ``FakeEngine.generate``'s (no sleep, no faults, no record)
        self.requests: dict[str, FakeRequest] = {}
        self.waiting: collections.deque[FakeRequest] = collections.deque()
        self.running: list[FakeRequest] = []
        self.pages_used = 0
        self.pages: collections.OrderedDict[tuple[int, ...], None] = collections.OrderedDict()
        self.prefix_queried = self.prefix_hits = 0
        self._rng = random.Random(0)

    def enqueue(self, prepared: PreparedRequest, request_id: str | None = None,
                arrival_time: float | None = None, ttft_slo: float | None = None,
                tpot_slo: float | None = None, priority: int = 0) -> str:
        rid = request_id if request_id is not None else f"fake-{len(self.fake.received)}"
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        p = prepared.params
        if p.temperature > 0 and p.seed is None:  # sampled: a seed of its own, as the engine
            prepared = dataclasses.replace(prepared, params=dataclasses.replace(
                p, seed=self._rng.getrandbits(32)))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        req = FakeRequest(rid, prepared, arrival, ttft_slo, tpot_slo, priority,
                          StopText(self.fake.tokenizer, p, self.fake.info.eos_token_ids),
                          RequestMetrics(arrival),
                          logprobs=[] if p.logprobs is not None else None)
        self.requests[rid] = req
        self.waiting.append(req)
        if self.live:
            self.fake.received.append(req)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        return None if req is None else self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def cancel_in_flight(self, reason: str) -> list[RequestOutput]:
        return []  # nothing runs between steps

    def step(self) -> list[RequestOutput]:
        fake = self.fake
        if self.live and fake.step_s > 0:
            time.sleep(fake.step_s)
        if self.live and fake._step_faults:
            raise fake._step_faults.popleft()
        now = time.monotonic()
        self._admit(now)
        outputs = []
        for req in list(self.running):
            self._next_token(req, now)
            if req.finish_reason is None and self.live and fake._request_fault(req.prepared):
                self._finish(req, "abort", "injected request fault")
            elif req.finish_reason is not None:
                self._finish(req, req.finish_reason)
            outputs.append(req.output())
        return outputs

    def _admit(self, now: float) -> None:
        fake = self.fake
        while self.waiting and len(self.running) < fake.info.max_num_seqs:
            req = self.waiting[0]
            p = req.prepared
            need = fake.intake.allocator.pages_for(len(p.prompt_ids) + p.params.max_tokens)
            if need > fake.info.num_kv_pages - self.pages_used:
                return
            self.waiting.popleft()
            req.pages_held = need
            self.pages_used += need
            self.prefix_queried += len(p.prompt_ids)
            self.prefix_hits += self.cached(p.prompt_ids)
            self._remember(p.prompt_ids)
            req.metrics.first_scheduled_time = now
            self.running.append(req)

    def _next_token(self, req: FakeRequest, now: float) -> None:
        fake, p = self.fake, req.prepared.params
        n = len(req.ids)
        if p.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = [None] + [
                TokenLogprob(t, -0.5, self._made_up(t, p.prompt_logprobs), 2)
                for t in req.prepared.prompt_ids[1:]]
        if p.max_tokens == 0:  # the prompt scored, nothing generated
            req.finish_reason = "length"
            return
        tok = fake.script(req.prepared.prompt_ids, p, n + adapter_offset(req.prepared.adapter))
        req.ids.append(tok)
        if req.logprobs is not None:
            req.logprobs.append(TokenLogprob(tok, -0.25, self._made_up(tok, p.logprobs)))
        m = req.metrics
        m.first_token_time = m.first_token_time or now
        m.token_times.append(now)
        if req.out.add(tok):
            req.finish_reason = "stop"
        elif n + 1 >= p.max_tokens or len(req.prepared.prompt_ids) + n + 1 >= \
                fake.info.max_model_len:
            req.out.finish()
            req.finish_reason = "length"

    def _made_up(self, tok: int, n: int) -> tuple[tuple[int, float], ...]:
        """``n`` alternatives of ``tok``: the ids after it, logprobs -0.25, -1.25, ..."""
        return tuple((t % self.fake.info.vocab_size, -0.25 - k)
                     for k, t in enumerate(range(tok, tok + n)))

    def _finish(self, req: FakeRequest, reason: str, error: str | None = None
                ) -> RequestOutput:
        req.finish_reason, req.error = reason, error
        req.metrics.finished_time = time.monotonic()
        self.requests.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
            self.pages_used -= req.pages_held
            req.pages_held = 0
        elif req in self.waiting:
            self.waiting.remove(req)
        return req.output()

    # -- the prefix cache ------------------------------------------------------------------
    def _page_keys(self, ids: Sequence[int]) -> list[tuple[int, ...]]:
        page = self.fake.info.page_size
        return [tuple(ids[:k * page]) for k in range(1, (len(ids) - 1) // page + 1)]

    def cached(self, ids: Sequence[int]) -> int:
        """Leading tokens of ``ids`` in whole remembered pages (the last token left to
        compute), as the engine's admission would take them."""
        n = 0
        for key in self._page_keys(ids):
            if key not in self.pages:
                break
            n = len(key)
        return n

    def _remember(self, ids: Sequence[int]) -> None:
        if not self.fake.info.prefix_caching:
            return
        for key in self._page_keys(ids):
            self.pages[key] = None
            self.pages.move_to_end(key)
        while len(self.pages) > self.fake.info.num_kv_pages:
            self.pages.popitem(last=False)


class FakeEngine(EngineLoop):
    """An engine with ``info`` as given and tokens from ``script``; start and use it as any
    ``EngineClient`` (``Server(FakeEngine(), config)``)."""

    def __init__(self, *, script: Script = text_script, step_s: float = 0.002,
                 vocab_size: int = 320, max_model_len: int = 512, page_size: int = 16,
                 num_kv_pages: int = 512, max_num_seqs: int = 8,
                 eos_token_ids: tuple[int, ...] = (ByteTokenizer.EOS,),
                 tokenizer: Tokenizer | None = ByteTokenizer(), scheduler: str = "fake",
                 prefix_caching: bool = True, lone_decode_s: float = 0.0,
                 prefill_s_per_token: float = 1e-4,
                 isolated_prefill: Callable[[int], float] | None = None,
                 max_waiting: int = 1024, idle_poll_s: float = 1.0,
                 lora: LoRAConfig | None = None):
        self.script = script
        self.step_s = step_s
        self.tokenizer = tokenizer
        self.info = EngineInfo(
            vocab_size=vocab_size, max_model_len=max_model_len,
            eos_token_ids=tuple(eos_token_ids), has_tokenizer=tokenizer is not None,
            scheduler=scheduler, page_size=page_size, num_kv_pages=num_kv_pages,
            max_num_seqs=max_num_seqs, prefix_caching=prefix_caching,
            lone_decode_s=lone_decode_s, max_loras=lora.max_loras if lora else 0,
            max_lora_rank=lora.max_lora_rank if lora else 0,
            runtime_lora_updating=bool(lora and lora.runtime_updating))
        self.lora_adapters = FakeAdapters(lora.modules) if lora is not None else None
        self.prefill_s_per_token = prefill_s_per_token
        self._isolated = isolated_prefill or (lambda n: 0.0)
        # The engine's intake over a pool of ``num_kv_pages`` (plus the allocator's sink).
        self.intake = RequestIntake(tokenizer, vocab_size, max_model_len,
                                    PageAllocator(num_kv_pages + 1, page_size),
                                    tuple(eos_token_ids), adapters=self.lora_adapters)
        self._step_faults: collections.deque[BaseException] = collections.deque()
        self._request_fault: Callable[[PreparedRequest], bool] = lambda prepared: False
        self.received: collections.deque[FakeRequest] = collections.deque(maxlen=10_000)
        super().__init__(_Core(self), max_waiting=max_waiting, idle_poll_s=idle_poll_s)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None
                 ) -> RequestOutput:
        """What a request gets, run alone here and now (the fake's ``LLM.generate``; a
        sampled request without a seed gets one at random, as on the server)."""
        core = _Core(self, live=False)
        core.enqueue(self.prepare(prompt, params), "offline")
        while True:
            for out in core.step():
                if out.finished:
                    return out

    @classmethod
    def for_model(cls, model: str, **kw) -> FakeEngine:
        """A fake with ``model``'s tokenizer (chat template, vocabulary, EOS ids) when it
        is a checkpoint directory with one (``jserve serve --fake-engine --model DIR``), the
        byte tokenizer otherwise."""
        tok = load_tokenizer(model) if os.path.isdir(model) else None
        if tok is None or isinstance(tok, ByteTokenizer):
            return cls(**kw)
        return cls(tokenizer=tok, vocab_size=tok.vocab_size,
                   eos_token_ids=tuple(getattr(tok, "eos_token_ids", ())), **kw)

    # -- faults ----------------------------------------------------------------------------
    def fail_steps(self, error: BaseException, times: int = 1) -> None:
        """The next ``times`` steps raise ``error``."""
        self._step_faults.extend([error] * times)

    def fail_requests(self, pick: Callable[[PreparedRequest], bool]) -> None:
        """Requests ``pick`` chooses end with an engine error after their first token."""
        self._request_fault = pick

    # -- any thread ------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool = True
                 ) -> list[int]:
        return list(self.intake.tokenize(prompt, add_special_tokens)[1])

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return decode_ids(self.tokenizer, token_ids, self.info.vocab_size)

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                adapter: str | None = None) -> PreparedRequest:
        """The engine's own intake (``RequestIntake``): its checks and messages."""
        return self.intake.prepare(prompt, params, adapter)

    def isolated_prefill_s(self, prompt_tokens: int) -> float:
        return self._isolated(prompt_tokens)

    def attach_metrics(self, metrics: ServerMetrics) -> None:
        super().attach_metrics(metrics)
        metrics.watch_grammars(self.intake.grammars)

    # -- engine thread ---------------------------------------------------------------------
    def _counters(self) -> EngineCounters:
        c = self.core
        total = self.info.num_kv_pages
        return EngineCounters(
            requests=len(c.requests), waiting=len(c.waiting), running=len(c.running),
            pages_used=c.pages_used, pages_free=total - c.pages_used, pages_total=total,
            preemptions=0, prefix_queried=c.prefix_queried, prefix_hits=c.prefix_hits,
            cached_pages=len(c.pages))

    def _check(self) -> None:
        c = self.core
        held = sum(r.pages_held for r in c.running)
        assert held == c.pages_used <= self.info.num_kv_pages, (held, c.pages_used)
        assert all(not r.pages_held for r in c.waiting)

    def _load(self, replica: str, now: float, healthy: bool) -> ReplicaLoad:
        c, info = self.core, self.info
        table = PrefillTable.sample(lambda n: n * self.prefill_s_per_token,
                                    max(info.max_model_len, 2))
        prefills = tuple(QueuedPrefill(
            r.ttft_slo - (now - r.arrival_time) if r.ttft_slo is not None else math.inf,
            table.remaining(len(r.prepared.prompt_ids), 0), len(r.prepared.prompt_ids))
            for r in c.waiting)
        return ReplicaLoad(replica=replica, healthy=healthy, waiting=len(c.waiting),
                           running=len(c.running),
                           kv_usage=c.pages_used / max(info.num_kv_pages, 1), order=FIFO,
                           prefills=prefills, table=table, max_num_seqs=info.max_num_seqs)

    def _cached_tokens(self, prompt_ids: Sequence[int]) -> int:
        return self.core.cached(prompt_ids)

    def _adapter_registry(self) -> dict[str, str]:
        return {} if self.lora_adapters is None else self.lora_adapters.known

    def _add_adapter(self, name: str, path: str) -> None:
        if self.lora_adapters is None:
            return super()._add_adapter(name, path)
        if not os.path.isdir(path):
            raise FieldError("lora_path", f"adapter {path}: no such directory")
        self.lora_adapters.known[name] = path

    def _remove_adapter(self, name: str) -> None:
        users = sum(r.prepared.adapter == name for r in self.core.requests.values())
        if users:
            raise FieldError("lora_name", f"adapter {name!r} is in use by {users} request(s)")
        del self.lora_adapters.known[name]

    def _lora_state(self) -> LoRAState | None:
        if self.lora_adapters is None:
            return None
        c = self.core
        names = lambda reqs: tuple(sorted({r.prepared.adapter for r in reqs
                                           if r.prepared.adapter is not None}))
        return LoRAState(names(c.running), names(c.waiting))

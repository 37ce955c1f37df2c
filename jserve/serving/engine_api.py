"""The engine as the serving layer sees it: ``EngineClient``, and the values that cross it.

The front ends, the gateway, the limits, the router endpoints and the metrics talk to the
engine through this interface and nothing else, so a change inside the engine (scheduler,
allocator, runner) stops at its implementations, and the edge can be tested against an
engine that compiles nothing. ``EngineLoop``'s thread runs two implementations,
``LiveEngine`` (``live_engine``: ``LLMEngine``) and ``FakeEngine`` (``fake_engine``: scripted
tokens, no JAX); ``ProcessEngine`` (``process_engine``) runs a ``LiveEngine`` in a process of
its own. Shaped after JetStream's ``engine_api`` and vLLM v1's ``EngineCoreClient``:
requests in, a stream of deltas out, and reports read between steps.

No JAX and no engine import here.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

from jserve.engine.requests.output import TokenLogprob
from jserve.routing.load import ReplicaLoad
from jserve.sampling.params import SamplingParams
from jserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import numpy as np

    from jserve.pooling import PoolingSpec
    from jserve.serving.metrics import ServerMetrics

# Error kinds a stream can end with (the front ends map them to gRPC and HTTP statuses).
INVALID = "invalid_argument"
EXHAUSTED = "resource_exhausted"
DEADLINE = "deadline_exceeded"
UNAVAILABLE = "unavailable"
INTERNAL = "internal"
ALREADY_EXISTS = "already_exists"  # a request id the engine holds already
NOT_FOUND = "not_found"     # a model (LoRA adapter) the engine does not serve


@dataclasses.dataclass
class Delta:
    """What one request got in one iteration (``finish_reason`` or ``error`` on the last)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None        # 'stop' | 'length'
    error: tuple[str, str] | None = None    # (kind, message)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0                  # of the prompt, taken from the prefix cache
    timings: dict[str, float] | None = None
    # ``prompt_logprobs`` asked: the first delta's (entry i: prompt token i's; the first None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling engine's: the prompt's pooled vector, on the last delta
    # (``jserve.pooling``: raw, before ``dimensions`` and normalization)
    embedding: np.ndarray | None = None

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def error_delta(kind: str, message: str) -> Delta:
    return Delta([], "", [], error=(kind, message))


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What a client may know of the model and the engine; fixed once the engine is built
    (``GetModelInfo``, ``/v1/models``, ``/server_info`` and the limits read it)."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    has_tokenizer: bool
    scheduler: str          # the scheduling policy's name
    page_size: int          # tokens per KV page
    num_kv_pages: int
    max_num_seqs: int
    prefix_caching: bool
    lone_decode_s: float    # predicted time of a step with one decode: the floor of tpot_slo
    # runner "pooling" (``jserve.pooling.PoolingSpec``): the engine makes embeddings
    # and generates nothing; None: a generating engine
    pooling: PoolingSpec | None = None
    hidden_size: int = 0    # the embeddings' size
    num_labels: int = 0     # a sequence classifier's (cross-encoder's) labels; 0: none
    # LoRA (``--enable-lora``): adapters resident on the device at once (0: no adapters
    # served), the largest rank served, and whether adapters may be loaded and unloaded
    # while serving (``--enable-runtime-lora-updating``)
    max_loras: int = 0
    max_lora_rank: int = 0
    runtime_lora_updating: bool = False
    # Prefill/decode disaggregation: why this engine cannot export or import KV pages (None:
    # it can), and the bytes one token's KV takes in them
    kv_transfer: str | None = "this engine does not move KV pages"
    kv_bytes_per_token: int = 0

    @property
    def lora(self) -> bool:
        return self.max_loras > 0


@dataclasses.dataclass(frozen=True)
class WaitEstimate:
    """What a request of a given prompt would wait on this replica now (``/v1/route/wait``)."""

    cached_tokens: int      # leading prompt tokens the prefix cache holds
    predicted_ttft_s: float
    load: ReplicaLoad       # the report the prediction was made from


def decode_ids(tokenizer: Tokenizer | None, token_ids: Sequence[int], vocab_size: int) -> str:
    """``EngineClient.detokenize`` for any engine: ids in the model's vocabulary, decoded with
    special tokens written out (as vLLM's ``/detokenize``)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so no text for token ids")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"tokens outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return tokenizer.decode(list(token_ids), skip_special_tokens=False)


class Prepared(Protocol):
    """A request tokenized and validated by ``EngineClient.prepare`` (a frozen dataclass, so
    a front end may ``dataclasses.replace`` its params, e.g. one seed per choice)."""

    prompt: str | None      # the text, when the prompt came as text
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None     # the LoRA adapter it runs with (None: the base model)


class AdapterNotFound(LookupError):
    """``unload_adapter`` of a name no loaded adapter has."""


@runtime_checkable
class EngineClient(Protocol):
    """One engine behind the serving layer. ``prepare``, ``tokenize``, ``detokenize`` and
    ``isolated_prefill_s`` run on any thread (the gateway's intake threads): they read only
    what is fixed. The rest runs on the event loop; what reads engine state is answered by
    the engine's own thread between steps, so it is consistent and never races a step."""

    info: EngineInfo
    tokenizer: Tokenizer | None     # for chat templates and token strings; None: ids only
    max_waiting: int                # admission queue; one more is refused EXHAUSTED
    crashed: BaseException | None   # why the engine thread died, once it has

    @property
    def alive(self) -> bool:
        """The engine thread runs (False before ``start`` and after a crash or shutdown)."""

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams,
                adapter: str | None = None) -> Prepared:
        """Tokenized and validated, or ValueError naming the field (the offline API's own
        checks, so the server refuses exactly what ``LLM.generate`` refuses). ``adapter``:
        the name of a loaded LoRA adapter to run with (FieldError on ``model`` if none is
        loaded by that name, or the engine serves none); None: the base model."""

    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool = True
                 ) -> list[int]:
        """The prompt's ids (ValueError for an empty one or ids outside the vocabulary); text
        with the tokenizer's special tokens (BOS) unless not ``add_special_tokens``."""

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The ids' text, special tokens written out (ValueError for ids outside the
        vocabulary or a model without a tokenizer): ``/detokenize``."""

    def isolated_prefill_s(self, prompt_tokens: int) -> float:
        """Predicted seconds to the first token of a prompt run alone (0: no prediction):
        the floor of its ``ttft_slo``."""

    def attach_metrics(self, metrics: ServerMetrics) -> None:
        """Feeds ``metrics`` from now on: token latencies and engine gauges as steps end, the
        engine's own counters (grammar cache, speculation) at each scrape. Before ``start``."""

    def start(self, loop: asyncio.AbstractEventLoop | None = None,
              on_crash: Callable[[BaseException], None] | None = None) -> None:
        """Starts the engine thread; its deltas go to ``loop`` (default: the running one),
        ``on_crash(error)`` is called there if the thread dies."""

    def shutdown(self, timeout: float | None = None) -> None:
        """Ends every request in flight with UNAVAILABLE and stops the engine thread."""

    def submit(self, request_id: str, prepared: Prepared, *, arrival_time: float,
               deadline: float | None = None, ttft_slo: float | None = None,
               tpot_slo: float | None = None, priority: int = 0) -> asyncio.Queue[Delta]:
        """Queues a prepared request; its ``Delta`` stream, one per step that produced
        tokens for it. A refusal (an id in use, a full admission queue, a passed
        ``deadline``, a ``time.monotonic()`` instant) is the stream's only, last, Delta."""

    def abort(self, request_id: str) -> None:
        """The client is gone: the request ends at the next step, its KV pages freed."""

    async def stats(self) -> dict[str, int]:
        """Counters read between steps, the KV pool checked whole: in_flight,
        engine_requests, engine_busy, waiting, running, pages_used, pages_free,
        pages_total, preemptions."""

    async def ping(self) -> None:
        """Returns once the engine thread answers between steps (``/health_generate``)."""

    async def adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters, name -> path ({}: none), in the order they were
        loaded, as the engine thread saw them after the last load or unload."""

    async def load_adapter(self, name: str, path: str) -> None:
        """Reads, checks and registers the LoRA adapter at ``path`` as ``name`` between
        steps; FieldError (on ``lora_name`` or ``lora_path``) naming what is wrong if it is
        refused (a name loaded already, a bad adapter, an engine without LoRA), nothing
        changed then and no request disturbed."""

    async def unload_adapter(self, name: str) -> None:
        """Unregisters adapter ``name`` between steps; ``AdapterNotFound`` if none is loaded
        by that name, FieldError (``lora_name``) while requests use it."""

    async def export_kv(self, token_ids: Sequence[int], adapter: str | None = None) -> bytes:
        """The wire form (``jserve.engine.device.kv_transfer``) of the KV pages this engine's prefix
        cache holds of the prompt ``token_ids`` (run with LoRA ``adapter``), read between
        steps: as many leading pages as are still cached, maybe none."""

    async def import_kv(self, token_ids: Sequence[int], wire: bytes,
                        adapter: str | None = None) -> tuple[int, int]:
        """Writes another engine's ``export_kv`` of the same prompt into this engine's prefix
        cache between steps: (pages new here, pages sent that the cache now holds). ValueError
        when they are not this engine's pages (nothing changed)."""

    async def load_report(self, replica: str, *, healthy: bool = True) -> ReplicaLoad:
        """This replica's ``ReplicaLoad`` now, as a router reads it (``/v1/route/load``,
        Ray Serve's routing stats)."""

    async def predicted_wait(self, replica: str, prompt_ids: Sequence[int] | None,
                             prompt_tokens: int, ttft_slo: float | None = None, *,
                             healthy: bool = True) -> WaitEstimate:
        """What a ``prompt_tokens`` request would wait here now, less the prefix of
        ``prompt_ids`` (None: only a length is known) this replica has cached."""

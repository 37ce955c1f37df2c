"""The engine in a thread of its own, fed by a thread-safe command queue, streaming to asyncio.

An engine core (``LLMEngine``, or the fake one) is not thread-safe, so exactly one thread
(this loop's) touches it. The asyncio side never calls the core: it puts commands (add,
abort, run-this-function) on a ``queue.SimpleQueue`` and the engine thread applies them
between steps, so an abort lands at the next iteration and frees the request's pages before
the next ``schedule()``. Outputs go back through ``loop.call_soon_threadsafe`` into one
``asyncio.Queue`` per request, one callback per iteration for all requests.

``EngineLoop`` is the part of ``EngineClient`` (``engine_api``) every engine shares: the
thread, the streams, deadlines, the admission queue, latency metrics and per-request fault
isolation. A subclass says what its core is (``LiveEngine``, ``FakeEngine``): its counters,
its reports, its model info and intake.

Text deltas hold back what a stop string completed later could still cut (``HeldBack``).
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Protocol, Sequence

from jserve.engine.requests.output import HeldBack, RequestOutput
from jserve.fields import FieldError
from jserve.os_threads import name_os_thread
from jserve.routing.load import ReplicaLoad, predicted_ttft
from jserve.serving.engine_api import (
    ALREADY_EXISTS,
    DEADLINE,
    EXHAUSTED,
    INTERNAL,
    NOT_FOUND,
    UNAVAILABLE,
    AdapterNotFound,
    Delta,
    Prepared,
    WaitEstimate,
    error_delta,
)
from jserve.serving.metrics import LoRAState, ServerMetrics

log = logging.getLogger(__name__)


class EngineCore(Protocol):
    """What the loop drives, on its thread only: ``LLMEngine``'s step API."""

    def enqueue(self, prepared: Prepared, request_id: str | None = None,
                arrival_time: float | None = None, ttft_slo: float | None = None,
                tpot_slo: float | None = None, priority: int = 0) -> str:
        """Queues a prepared request; ValueError only for an id already in use."""

    def abort(self, request_id: str) -> object:
        """Ends a request now (nothing if unknown or done)."""

    def step(self) -> list[RequestOutput]:
        """One iteration: the outputs of the requests it advanced or ended."""

    def has_unfinished(self) -> bool: ...

    def cancel_in_flight(self, reason: str) -> object:
        """Ends the steps in flight (shutdown, crash)."""


@dataclasses.dataclass(frozen=True)
class EngineCounters:
    """A core's state between steps (totals since start for the counters)."""

    requests: int           # requests the core holds
    waiting: int
    running: int
    pages_used: int
    pages_free: int
    pages_total: int
    preemptions: int
    prefix_queried: int = 0
    prefix_hits: int = 0
    cached_pages: int = 0


@dataclasses.dataclass(eq=False)
class _Live:
    """Engine-thread bookkeeping of one request in flight."""

    sink: asyncio.Queue
    deadline: float | None
    text: HeldBack
    prompt_tokens: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_prompt_logprobs: bool = False
    last_token_time: float | None = None


_STOP = object()


class EngineLoop(abc.ABC):
    """Owns ``core`` from ``start()`` until ``shutdown()`` returns. A subclass gives
    ``_counters`` (and ``_check``, ``_load``, ``_cached_tokens``: engine thread) and the
    rest of ``EngineClient``."""

    def __init__(self, core: EngineCore, *, max_waiting: int = 1024,
                 idle_poll_s: float = 1.0):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.core = core
        self.metrics: ServerMetrics | None = None
        self.max_waiting = max_waiting
        self._idle_poll_s = idle_poll_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.crashed: BaseException | None = None
        self._stop_sent = False
        self._on_crash: Callable[[BaseException], None] | None = None
        # The LoRA adapters (name -> path) as the engine thread last saw them: taken at
        # start and after each load or unload, replaced whole, never changed in place
        self._adapters_seen: dict[str, str] | None = None

    # -- what a subclass says about its core (engine thread) -------------------------------
    @abc.abstractmethod
    def _counters(self) -> EngineCounters:
        """The core's state now (every iteration, for the gauges; and admission)."""

    @abc.abstractmethod
    def _check(self) -> None:
        """Asserts the KV pool is whole (``stats``)."""

    @abc.abstractmethod
    def _load(self, replica: str, now: float, healthy: bool) -> ReplicaLoad:
        """This replica's routing report at ``now``."""

    def _cached_tokens(self, prompt_ids: Sequence[int]) -> int:
        return 0

    # LoRA adapters (engine thread; an engine that serves none keeps these defaults)
    def _adapter_registry(self) -> dict[str, str]:
        """The loaded adapters, name -> path."""
        return {}

    def _add_adapter(self, name: str, path: str) -> None:
        """Registers an adapter not loaded yet (FieldError if refused, nothing changed)."""
        raise FieldError("lora_name", f"adapter {name!r}: this engine serves no LoRA "
                                      "adapters (start it with --enable-lora)")

    def _remove_adapter(self, name: str) -> None:
        """Unregisters a loaded adapter (FieldError while requests use it)."""
        raise AssertionError("no adapter is loaded")  # (``unload_adapter`` checks first)

    def _lora_state(self) -> LoRAState | None:
        """The adapters of the running and waiting requests, and the slot pool's totals
        (None: no LoRA)."""
        return None

    # KV pages (prefill/decode disaggregation, engine thread; ``info.kv_transfer`` None:
    # an engine that does not move pages keeps these)
    def _export_kv(self, token_ids: list[int], adapter: str | None) -> bytes:
        raise FieldError("kv_transfer_params", "this engine does not move KV pages")

    def _import_kv(self, token_ids: list[int], wire: bytes, adapter: str | None
                   ) -> tuple[int, int]:
        raise FieldError("kv_transfer_params", "this engine does not move KV pages")

    # -- asyncio side ------------------------------------------------------------------
    def attach_metrics(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        if self.info.lora:
            metrics.watch_lora(self.info.max_loras)

    def start(self, loop: asyncio.AbstractEventLoop | None = None,
              on_crash: Callable[[BaseException], None] | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._on_crash = on_crash  # called on the event loop if the engine thread dies
        self._adapters_seen = dict(self._adapter_registry())  # (the thread is not running)
        self._thread = threading.Thread(target=self._run, name="jserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request_id: str, prepared: Prepared, *, arrival_time: float,
               deadline: float | None = None, ttft_slo: float | None = None,
               tpot_slo: float | None = None, priority: int = 0) -> asyncio.Queue:
        """Queues an add of a request prepared (tokenized, validated) by the caller; returns
        its queue of ``Delta``s. ``deadline`` is a ``time.monotonic()`` instant. Errors (an id
        in use, a full admission queue, a passed deadline) arrive as the stream's last
        Delta."""
        sink: asyncio.Queue = asyncio.Queue()
        self._cmds.put(lambda out: self._add(out, sink, request_id, prepared, arrival_time,
                                             deadline, ttft_slo, tpot_slo, priority))
        return sink

    def abort(self, request_id: str) -> None:
        """Client gone: drop the request at the next iteration; nothing more is sent."""
        self._cmds.put(lambda out: self._abort(request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs ``fn(core)`` on the engine thread between steps; returns its result. (For
        the loop's own reports and for tests; the serving layer uses the reports.)"""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run(out):
            try:
                result, exc = fn(self.core), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, exc = None, e
            loop.call_soon_threadsafe(
                lambda: fut.done() or (fut.set_exception(exc) if exc else fut.set_result(result)))
        self._cmds.put(run)
        return await fut

    async def stats(self) -> dict[str, int]:
        """Engine counters read on the engine thread (consistent between steps)."""
        def read(core) -> dict[str, int]:
            self._check()
            c = self._counters()
            return dict(in_flight=len(self._live), engine_requests=c.requests,
                        engine_busy=int(core.has_unfinished()), waiting=c.waiting,
                        running=c.running, pages_used=c.pages_used,
                        pages_free=c.pages_free, pages_total=c.pages_total,
                        preemptions=c.preemptions)
        return await self.call(read)

    async def ping(self) -> None:
        await self.call(lambda core: None)

    async def adapters(self) -> dict[str, str]:
        """As of the last load or unload (which the engine thread publishes): no round trip,
        so a listing never waits for a long step or a compile."""
        seen = self._adapters_seen
        return dict(self._adapter_registry() if seen is None else seen)  # (None: not started)

    async def load_adapter(self, name: str, path: str) -> None:
        def load(core) -> None:
            old = self._adapter_registry().get(name)
            if old is not None:
                raise FieldError("lora_name", f"the LoRA adapter {name!r} has already been "
                                              f"loaded (from {old})")
            self._add_adapter(name, path)
            self._adapters_seen = dict(self._adapter_registry())
            log.info("loaded LoRA adapter %r from %s", name, path)
        await self.call(load)

    async def unload_adapter(self, name: str) -> None:
        def unload(core) -> None:
            if name not in self._adapter_registry():
                raise AdapterNotFound(f"the LoRA adapter {name!r} cannot be found")
            self._remove_adapter(name)
            self._adapters_seen = dict(self._adapter_registry())
            log.info("unloaded LoRA adapter %r", name)
        await self.call(unload)

    async def export_kv(self, token_ids: Sequence[int], adapter: str | None = None) -> bytes:
        ids = list(token_ids)
        return await self.call(lambda core: self._export_kv(ids, adapter))

    async def import_kv(self, token_ids: Sequence[int], wire: bytes,
                        adapter: str | None = None) -> tuple[int, int]:
        ids = list(token_ids)
        return await self.call(lambda core: self._import_kv(ids, wire, adapter))

    async def load_report(self, replica: str, *, healthy: bool = True) -> ReplicaLoad:
        return await self.call(lambda core: self._load(replica, time.monotonic(), healthy))

    async def predicted_wait(self, replica: str, prompt_ids: Sequence[int] | None,
                             prompt_tokens: int, ttft_slo: float | None = None, *,
                             healthy: bool = True) -> WaitEstimate:
        def read(core) -> tuple[ReplicaLoad, int]:
            load = self._load(replica, time.monotonic(), healthy)
            return load, self._cached_tokens(prompt_ids) if prompt_ids is not None else 0
        load, cached = await self.call(read)
        return WaitEstimate(cached, predicted_ttft(load, prompt_tokens, cached, ttft_slo), load)

    def shutdown(self, timeout: float | None = None) -> None:
        """Ends every request still in flight with UNAVAILABLE and stops the thread."""
        if self._thread is None:
            return
        if not self._stop_sent:
            self._stop_sent = True
            self._cmds.put(_STOP)
        self._thread.join(timeout)

    # -- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread()
        eng = self.core
        try:
            while True:
                out: list[tuple[asyncio.Queue, Delta]] = []
                cmds = self._drain(block=not eng.has_unfinished())
                stop = False
                for cmd in cmds:  # adds after a stop are taken, then failed with the rest
                    if cmd is _STOP:
                        stop = True
                    else:
                        cmd(out)
                if stop:
                    self._fail_all(out, UNAVAILABLE, "the server is shutting down")
                    eng.cancel_in_flight("the server is shutting down")
                    self._publish(out)
                    self._update_metrics(0)
                    return
                self._expire(out)
                new_tokens = 0
                if eng.has_unfinished():
                    try:
                        outputs = eng.step()
                    except Exception as e:  # noqa: BLE001 - fail requests, keep serving
                        log.exception("engine iteration failed")
                        self._fail_all(out, INTERNAL, f"engine iteration failed: {e}")
                        outputs = []
                    now = time.monotonic()
                    for o in outputs:
                        new_tokens += self._on_output(out, o, now)
                self._publish(out)
                self._update_metrics(new_tokens)
        except BaseException as e:  # noqa: BLE001 - tell every waiting client, then end
            log.exception("engine loop crashed")
            self.crashed = e
            out = []
            self._fail_all(out, INTERNAL, f"engine loop crashed: {e}")
            try:
                eng.cancel_in_flight(f"engine loop crashed: {e}")
            except Exception:  # noqa: BLE001 - the engine may be what broke
                log.exception("could not release the steps in flight")
            self._publish(out)
            if self._on_crash is not None:
                self._loop.call_soon_threadsafe(self._on_crash, e)

    def _drain(self, block: bool) -> list:
        cmds = []
        if block:
            try:
                cmds.append(self._cmds.get(timeout=self._idle_poll_s))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return cmds

    def _add(self, out, sink, request_id, prepared, arrival_time, deadline, ttft_slo,
             tpot_slo, priority) -> None:
        """Queues one request on the engine, or ends its stream with why not: a refusal
        (ALREADY_EXISTS, EXHAUSTED, DEADLINE, NOT_FOUND) or, for a failure of ours, INTERNAL
        with the engine left without it."""
        try:
            self._enqueue(out, sink, request_id, prepared, arrival_time, deadline, ttft_slo,
                          tpot_slo, priority)
        except Exception as e:  # noqa: BLE001 - one request's failure ends it alone
            log.exception("request %s: intake on the engine thread failed", request_id)
            self._live.pop(request_id, None)
            self.core.abort(request_id)  # nothing if the core never took it
            out.append((sink, error_delta(INTERNAL, f"request intake failed: {e}")))

    def _enqueue(self, out, sink, request_id, prepared, arrival_time, deadline, ttft_slo,
                 tpot_slo, priority) -> None:
        if self._counters().waiting >= self.max_waiting:
            out.append((sink, error_delta(EXHAUSTED, f"admission queue full "
                                                f"({self.max_waiting} requests waiting)")))
            return
        if deadline is not None and time.monotonic() >= deadline:
            out.append((sink, error_delta(DEADLINE, "deadline passed before admission")))
            return
        adapter = prepared.adapter
        if adapter is not None and adapter not in self._adapter_registry():
            # checked at prepare, on an intake thread; unloaded since
            out.append((sink, error_delta(NOT_FOUND, f"model {adapter!r} does not exist: its "
                                                     "LoRA adapter was unloaded")))
            return
        try:
            self.core.enqueue(prepared, request_id=request_id, arrival_time=arrival_time,
                        ttft_slo=ttft_slo, tpot_slo=tpot_slo, priority=priority)
        except ValueError as e:  # the one check of ids: the core's (gateway ids are fresh)
            out.append((sink, error_delta(ALREADY_EXISTS, str(e))))
            return
        prompt_tokens = len(prepared.prompt_ids)
        self._live[request_id] = _Live(sink, deadline, HeldBack(prepared.params.stop),
                                       prompt_tokens)
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(prompt_tokens)

    def _abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.core.abort(request_id)

    def _expire(self, out) -> None:
        now = time.monotonic()
        expired = [rid for rid, lv in self._live.items()
                   if lv.deadline is not None and now >= lv.deadline]
        for rid in expired:
            lv = self._live.pop(rid)
            self.core.abort(rid)
            out.append((lv.sink, error_delta(DEADLINE, f"deadline passed after {lv.sent_tokens} "
                                                  f"generated tokens")))

    def _fail_all(self, out, kind: str, message: str) -> None:
        for rid, lv in list(self._live.items()):
            self.core.abort(rid)
            out.append((lv.sink, error_delta(kind, message)))
        self._live.clear()

    def _on_output(self, out, o: RequestOutput, now: float) -> int:
        """``o``'s delta for its stream (its new tokens' count); a failure of ours here ends
        that request alone, INTERNAL, its pages freed."""
        lv = self._live.get(o.request_id)
        if lv is None:
            return 0
        try:
            return self._delta(out, lv, o, now)
        except Exception as e:  # noqa: BLE001 - one request's failure ends it alone
            log.exception("request %s: output processing failed", o.request_id)
            if self._live.pop(o.request_id, None) is not None:
                self.core.abort(o.request_id)
            out.append((lv.sink, error_delta(INTERNAL, f"output processing failed: {e}")))
            return 0

    def _delta(self, out, lv: _Live, o: RequestOutput, now: float) -> int:
        ids = o.new_token_ids(lv.sent_tokens)
        lv.sent_tokens += len(ids)
        lps = o.new_logprobs(lv.sent_logprobs)
        lv.sent_logprobs += len(lps)
        text = lv.text.take(o.text, o.finished)
        m = self.metrics
        if m is not None and ids:
            if lv.last_token_time is None:
                m.ttft.observe(now - o.metrics.arrival_time)
            else:
                m.tpot.observe((now - lv.last_token_time) / len(ids))
            lv.last_token_time = now
        delta = Delta(ids, text, lps)
        if o.prompt_logprobs is not None and not lv.sent_prompt_logprobs:
            delta.prompt_logprobs = list(o.prompt_logprobs)  # whole: the prompt is prefilled
            lv.sent_prompt_logprobs = True
        if o.finished:
            del self._live[o.request_id]
            if o.error is not None or o.finish_reason not in ("stop", "length"):
                delta.error = (INTERNAL, o.error or f"request ended with {o.finish_reason}")
            else:
                delta.finish_reason = o.finish_reason
                delta.embedding = o.embedding
                delta.prompt_tokens = lv.prompt_tokens
                delta.cached_tokens = o.metrics.cached_tokens
                delta.completion_tokens = lv.sent_tokens
                delta.timings = _timings(o)
                if m is not None:
                    m.finished(delta.timings, lv.prompt_tokens, lv.sent_tokens)
        out.append((lv.sink, delta))
        return len(ids)

    def _publish(self, out: list[tuple[asyncio.Queue, Delta]]) -> None:
        if not out:
            return
        try:
            self._loop.call_soon_threadsafe(_deliver, out)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _update_metrics(self, new_tokens: int) -> None:
        if self.metrics is None:
            return
        c = self._counters()
        self.metrics.engine_state(
            waiting=c.waiting, running=c.running, pages_used=c.pages_used,
            pages_free=c.pages_free, preemptions=c.preemptions, new_tokens=new_tokens,
            prefix_queried=c.prefix_queried, prefix_hits=c.prefix_hits,
            cached_pages=c.cached_pages)
        lora = self._lora_state()
        if lora is not None:
            self.metrics.lora = lora


def _deliver(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for sink, delta in items:
        sink.put_nowait(delta)


def _timings(o: RequestOutput) -> dict[str, float]:
    m = o.metrics
    t = m.token_times
    return dict(
        queue_seconds=(m.first_scheduled_time or m.arrival_time) - m.arrival_time,
        time_to_first_token=(m.first_token_time or m.arrival_time) - m.arrival_time,
        time_per_output_token=(t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0,
        e2e_seconds=(m.finished_time or m.arrival_time) - m.arrival_time)

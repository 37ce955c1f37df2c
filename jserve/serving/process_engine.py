"""``EngineClient`` over an engine core in a child process (``jserve serve --engine-process``):
the front end's Python (HTTP, SSE, gRPC, tokenization) no longer shares a GIL with the
engine's host work. vLLM v1's engine-core client, as the second live ``EngineClient``.

The parent keeps what the front end reads without a round trip: the model info, the
tokenizer and a ``RequestIntake`` of the engine's geometry (``Handshake``), so prompts are
tokenized and checked here and refused before anything crosses. A request crosses once,
prepared; its deltas come back one message per engine iteration, read on a thread, which
also makes their text (``_Stream``: detokenization and stop strings are the front end's, as
in vLLM v1), and handed to the event loop in one callback. Streams are keyed by wire ids
of the parent's (the core stays the one check of request ids). The reports are calls
answered between steps by the child's own ``LiveEngine`` methods.

If the child dies, every stream in flight ends INTERNAL and ``on_crash`` is called.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import jserve
from jserve.engine.requests.intake import RequestIntake
from jserve.engine.requests.output import HeldBack, StopText
from jserve.lora.slots import check_loaded
from jserve.os_threads import name_os_thread
from jserve.routing.load import ReplicaLoad
from jserve.sampling.params import SamplingParams
from jserve.serving.core_pipe import FrameSender, read_frames
from jserve.serving.core_process import Handshake, Step
from jserve.serving.engine_api import (
    INTERNAL,
    Delta,
    Prepared,
    WaitEstimate,
    decode_ids,
    error_delta,
)
from jserve.serving.live_engine import EngineSpec
from jserve.serving.metrics import ServerMetrics
from jserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class _AdapterNames:
    """``RequestIntake``'s adapter check against the adapters the child last reported."""

    def __init__(self, engine: ProcessEngine):
        self._engine = engine

    def check(self, name: str) -> None:
        check_loaded(name, self._engine._adapters_seen)


class _Scraped:
    """The scrape-time counters as the child last sent them (``Step.scrape``)."""

    def __init__(self):
        self.compiles = self.hits = 0
        self.speculation = {"draft_tokens": 0, "accepted_tokens": 0, "drafts": 0}
        self.kv_tier: dict | None = None

    def update(self, scrape: dict) -> None:
        self.compiles, self.hits = scrape["grammars"]
        self.speculation = scrape["speculation"] or self.speculation
        self.kv_tier = scrape["kv_tier"] or self.kv_tier

    def stats(self) -> dict:  # (as ``Speculator.stats``)
        return self.speculation


def for_core(prepared: Prepared) -> Prepared:
    """``prepared`` as the core gets it: its text is made here (``_Stream``), so the core
    neither detokenizes nor looks for stop strings."""
    return dataclasses.replace(prepared, params=dataclasses.replace(
        prepared.params, stop=(), detokenize=False))


class _Stream:
    """One request's stream on the front end's side: its text made from the core's token
    ids, by the same ``StopText`` the engine's own output processing runs (so stop tokens,
    stop strings and ``min_tokens`` cut at the same token), held back as the engine thread
    holds it (``HeldBack``). Used on the reader thread only."""

    def __init__(self, sink: asyncio.Queue, request_id: str, params: SamplingParams,
                 tokenizer: Tokenizer | None, eos_ids: tuple[int, ...]):
        self.sink, self.request_id = sink, request_id
        self.text = StopText(tokenizer, params, eos_ids)
        self.held = HeldBack(params.stop)
        self.tokens = 0      # generated tokens the client has been sent
        self.cut = False     # a stop string ended it here; the core's last delta is awaited

    def take(self, d: Delta) -> tuple[Delta | None, bool]:
        """``d`` as its client gets it (None: the core's tokens past a stop string), and
        whether a stop string ended the request here while the core runs it on."""
        if self.cut:
            if not d.last:
                return None, False
            d = dataclasses.replace(d, token_ids=[], text="", logprobs=[])
            if d.error is None:  # the usage and timings of the tokens sent
                d.finish_reason, d.completion_tokens = "stop", self.tokens
            return d, False
        keep = len(d.token_ids)
        stopped = False
        for i, tok in enumerate(d.token_ids):
            if self.text.add(tok):
                keep, stopped = i + 1, True
                break
        if keep < len(d.token_ids):
            d.token_ids, d.logprobs = d.token_ids[:keep], d.logprobs[:keep]
        self.tokens += keep
        if d.last and not stopped:
            self.text.finish()  # (a length limit, a grammar's end, an error)
        d.text = self.held.take(self.text.text, d.last or stopped)
        if stopped and d.finish_reason is not None:  # the core ran past it in this delta
            d.finish_reason, d.completion_tokens = "stop", self.tokens
        self.cut = stopped and not d.last
        return d, self.cut


class ProcessEngine:
    """Starts the child and waits for its engine to be built (``RuntimeError`` saying why it
    could not be); ``start`` then connects it to the event loop."""

    ISOLATED_WAIT_S = 5.0  # how long ``isolated_prefill_s`` waits for the core

    def __init__(self, spec: EngineSpec):
        mine, theirs = socket.socketpair()
        # A fresh interpreter (JAX starts there), importing this very jserve
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(jserve.__file__).parents[1]), *filter(None, [os.environ.get(
                "PYTHONPATH")])]))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from jserve.serving.core_process import main; main()",
             str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env,
            stdout=2)  # (its prints to the log: this process's stdout is its own)
        theirs.close()
        self._frames, self._sender = read_frames(mine), FrameSender(mine)
        self._sender.send(("spec", spec))
        try:
            kind, hello = next(self._frames)
        except (EOFError, OSError, StopIteration):
            raise RuntimeError(f"the engine core exited with {self._proc.wait()} while "
                               "starting") from None
        if kind == "failed":
            self._proc.wait()
            raise RuntimeError(f"the engine core could not start: {hello}")
        self._hello: Handshake = hello
        self.info = hello.info
        self.tokenizer = hello.tokenizer
        self._max_waiting = spec.max_waiting
        self.startup_line = hello.startup_line
        self._adapters_seen = dict(hello.adapters)
        self.intake = RequestIntake(
            hello.tokenizer, self.info.vocab_size, self.info.max_model_len, hello.allocator,
            hello.eos_ids, no_prompt_logprobs=hello.no_prompt_logprobs,
            adapters=_AdapterNames(self) if self.info.lora else None)
        self.crashed: BaseException | None = None
        self.metrics: ServerMetrics | None = None
        self._scraped = _Scraped()
        self._scraped.update(hello.scrape)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_crash: Callable[[BaseException], None] | None = None
        # wire id -> stream (added and removed on the event loop, read by the reader thread)
        self._streams: dict[int, _Stream] = {}
        self._wire_of: dict[str, int] = {}           # request id -> its live wire id
        self._rid_of: dict[int, str] = {}            # and back
        self._wires = itertools.count()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._bye = threading.Event()

    # -- any thread: what is fixed ---------------------------------------------------------
    def prepare(self, prompt: str | Sequence[int], params: SamplingParams,
                adapter: str | None = None) -> Prepared:
        return self.intake.prepare(prompt, params, adapter)

    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool = True
                 ) -> list[int]:
        return list(self.intake.tokenize(prompt, add_special_tokens)[1])

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return decode_ids(self.tokenizer, token_ids, self.info.vocab_size)

    def isolated_prefill_s(self, prompt_tokens: int) -> float:
        """The core's T(n), one round trip to its reader thread; 0 (no floor) when it cannot
        say within ``ISOLATED_WAIT_S`` or is gone: the request then meets the core's state
        at its submit, and an intake thread never waits on a hung core."""
        try:
            return self._request("isolated", prompt_tokens).result(self.ISOLATED_WAIT_S)
        except (concurrent.futures.TimeoutError, RuntimeError):
            log.warning("the engine core did not say a prompt's prefill time: no TTFT floor")
            return 0.0

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def max_waiting(self) -> int:
        return self._max_waiting

    @max_waiting.setter
    def max_waiting(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"max_waiting must be >= 1, got {n}")
        self._max_waiting = n
        self._send(("max_waiting", n))

    # -- event loop ------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive() and self.crashed is None

    def attach_metrics(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        if self.info.lora:
            metrics.watch_lora(self.info.max_loras)
        metrics.watch_grammars(self._scraped)
        if self._hello.scrape["speculation"] is not None:  # (the engine has a speculator)
            metrics.watch_speculation(self._scraped)
        if self._hello.scrape["kv_tier"] is not None:
            metrics.watch_kv_tier(lambda: self._scraped.kv_tier)

    def start(self, loop: asyncio.AbstractEventLoop | None = None,
              on_crash: Callable[[BaseException], None] | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._on_crash = on_crash
        self._reader = threading.Thread(target=self._read, name="jserve-core-client",
                                        daemon=True)
        self._reader.start()

    def submit(self, request_id: str, prepared: Prepared, *, arrival_time: float,
               deadline: float | None = None, ttft_slo: float | None = None,
               tpot_slo: float | None = None, priority: int = 0) -> asyncio.Queue:
        sink: asyncio.Queue = asyncio.Queue()
        if self.crashed is not None or not self.alive:
            sink.put_nowait(error_delta(INTERNAL, f"the engine core is gone: {self.crashed}"))
            return sink
        wire = next(self._wires)
        self._streams[wire] = _Stream(sink, request_id, prepared.params, self.tokenizer,
                                      self._hello.eos_ids)
        if request_id not in self._wire_of:  # (a second one is refused by the core)
            self._wire_of[request_id], self._rid_of[wire] = wire, request_id
        kw = dict(arrival_time=arrival_time, deadline=deadline, ttft_slo=ttft_slo,
                  tpot_slo=tpot_slo, priority=priority)
        self._send(("submit", wire, request_id, for_core(prepared), kw))
        return sink

    def abort(self, request_id: str) -> None:
        wire = self._wire_of.pop(request_id, None)
        if wire is not None:
            del self._rid_of[wire]
            self._streams.pop(wire, None)  # nothing more is sent to it
            self._send(("abort", request_id))

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.wrap_future(self._request("call", name, args, kwargs))

    async def stats(self) -> dict[str, int]:
        got = await self._call("stats")
        return dict(got, in_flight=len(self._streams))

    async def ping(self) -> None:
        await self._call("ping")

    async def adapters(self) -> dict[str, str]:
        return dict(self._adapters_seen)

    async def load_adapter(self, name: str, path: str) -> None:
        await self._call("load_adapter", name, path)
        self._adapters_seen = await self._call("adapters")

    async def unload_adapter(self, name: str) -> None:
        await self._call("unload_adapter", name)
        self._adapters_seen = await self._call("adapters")

    async def export_kv(self, token_ids: Sequence[int], adapter: str | None = None) -> bytes:
        return await self._call("export_kv", list(token_ids), adapter)

    async def import_kv(self, token_ids: Sequence[int], wire: bytes,
                        adapter: str | None = None) -> tuple[int, int]:
        return await self._call("import_kv", list(token_ids), wire, adapter)

    async def load_report(self, replica: str, *, healthy: bool = True) -> ReplicaLoad:
        return await self._call("load_report", replica, healthy=healthy)

    async def predicted_wait(self, replica: str, prompt_ids: Sequence[int] | None,
                             prompt_tokens: int, ttft_slo: float | None = None, *,
                             healthy: bool = True) -> WaitEstimate:
        ids = None if prompt_ids is None else list(prompt_ids)
        return await self._call("predicted_wait", replica, ids, prompt_tokens, ttft_slo,
                                healthy=healthy)

    def shutdown(self, timeout: float | None = None) -> None:
        """The child ends every request in flight UNAVAILABLE, then exits."""
        wait = None if timeout is None else timeout + 1.0
        if self._proc.poll() is None:
            self._send(("shutdown", timeout))
            if self.alive:  # its last deltas are handed to the event loop before "bye"
                self._bye.wait(wait)
        try:
            self._proc.wait(wait)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    # -- the pipe's threads ----------------------------------------------------------------
    def _request(self, kind: str, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.crashed is not None:
            fut.set_exception(RuntimeError(f"the engine core is gone: {self.crashed}"))
            return fut
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        self._send((kind, call_id, *args))
        return fut

    def _send(self, msg: tuple) -> None:
        self._sender.send(msg)

    def _read(self) -> None:
        name_os_thread()
        try:
            for msg in self._frames:
                kind = msg[0]
                if kind == "step":
                    self._to_loop(self._deliver, self._texts(msg[1]))
                elif kind == "reply":
                    _, call_id, result, exc = msg
                    fut = self._calls.pop(call_id)
                    fut.set_exception(exc) if exc is not None else fut.set_result(result)
                elif kind == "crashed":
                    self._gone(RuntimeError(msg[1]),
                               self._texts(Step(msg[2], [], None, 0, None)))
                    return
                elif kind == "bye":
                    self._bye.set()
                    return
        except (EOFError, OSError):
            try:
                code = self._proc.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            self._gone(RuntimeError(f"the engine core exited (exit code {code})"), None)

    def _gone(self, error: BaseException, last: Step | None) -> None:
        """The child died: the streams it ended still get their deltas (``last``: the
        crash's), the rest INTERNAL."""
        log.error("%s", error)
        self.crashed = error
        for fut in self._calls.values():
            fut.set_exception(error)
        self._calls.clear()
        self._bye.set()

        def fail() -> None:
            if last is not None:
                self._deliver(last)
            for stream in self._streams.values():
                stream.sink.put_nowait(error_delta(INTERNAL, str(error)))
            self._streams.clear()
            self._wire_of.clear()
            self._rid_of.clear()
            if self._on_crash is not None:
                self._on_crash(error)
        self._to_loop(fail)

    def _to_loop(self, fn: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _texts(self, step: Step) -> Step:
        """``step``'s deltas with their text (reader thread); a stop string found ends its
        request in the core."""
        deltas = []
        for wire, delta in step.deltas:
            stream = self._streams.get(wire)
            if stream is None:  # aborted since
                continue
            delta, stop = stream.take(delta)
            if stop:
                self._send(("stop_at", stream.request_id, stream.tokens))
            if delta is not None:
                deltas.append((wire, delta))
        step.deltas = deltas
        return step

    def _deliver(self, step: Step) -> None:
        """One iteration's deltas to their streams, its observations to the metrics."""
        m = self.metrics
        for wire, delta in step.deltas:
            stream = self._streams.get(wire)
            if stream is None:  # aborted here since
                continue
            stream.sink.put_nowait(delta)
            if delta.last:
                del self._streams[wire]
                rid = self._rid_of.pop(wire, None)
                if rid is not None:
                    del self._wire_of[rid]
                if m is not None and delta.finish_reason is not None:
                    m.finished(delta.timings, delta.prompt_tokens, delta.completion_tokens)
        if m is not None and step.counters is not None:
            replay(self.metrics, step)
        if step.scrape is not None:
            self._scraped.update(step.scrape)


def replay(m: ServerMetrics, step: Step) -> None:
    """``step``'s metric observations and gauges on the parent's metrics."""
    for name, value in step.observed:
        if name == "prompt_tokens":
            m.prompt_tokens.inc(value)
        else:
            getattr(m, name).observe(value)
    c = step.counters
    m.engine_state(waiting=c.waiting, running=c.running, pages_used=c.pages_used,
                   pages_free=c.pages_free, preemptions=c.preemptions,
                   new_tokens=step.new_tokens, prefix_queried=c.prefix_queried,
                   prefix_hits=c.prefix_hits, cached_pages=c.cached_pages)
    if step.lora is not None:
        m.lora = step.lora

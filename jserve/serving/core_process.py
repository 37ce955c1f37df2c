"""The engine core in a process of its own (``jserve serve --engine-process``): the child's
side of ``process_engine``.

In one process the event loop's and the intake threads' Python shares a GIL with the
engine thread's host work. Here the child runs the same ``LiveEngine`` loop over the same
``LLMEngine``; only its edges change: its streams are wire ids instead of asyncio queues,
and each iteration's deltas, metric observations and counters go to the parent as one
message on a pipe. The parent makes the text: requests come without stop strings and are
not detokenized here, and a stop string the parent finds ends its request here
(``stop_at``). Commands come back on a reader thread; the ``EngineClient`` reports
(``stats``, adapters, KV pages, routing) run on a small asyncio loop here, through the very
methods the thread engine answers them with.

The module imports no JAX: the parent imports it for the messages' types and starts a fresh
interpreter (``main``) that builds the engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Iterator

from jserve.os_threads import name_os_thread
from jserve.serving.core_pipe import FrameSender, read_frames
from jserve.serving.engine_api import INTERNAL, EngineInfo, error_delta
from jserve.serving.engine_loop import EngineCounters
from jserve.serving.live_engine import LiveEngine, build_engine
from jserve.serving.metrics import LoRAState
from jserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SCRAPE_EVERY_S = 0.5  # how stale the scrape-time counters (grammars, speculation, tier) get
# The EngineClient coroutines the parent may call here (each answered by LiveEngine's own)
CALLS = ("stats", "ping", "adapters", "load_adapter", "unload_adapter", "export_kv", "import_kv",
         "load_report", "predicted_wait")


@dataclasses.dataclass(frozen=True)
class Handshake:
    """What the parent needs of a built engine to run intake and answer what is fixed
    without a round trip."""

    info: EngineInfo
    tokenizer: Tokenizer | None
    eos_ids: tuple[int, ...]
    no_prompt_logprobs: str | None
    allocator: object             # a blank ``PageAllocator`` of the engine's geometry
    adapters: dict[str, str]      # loaded at start, name -> path
    startup_line: str
    scrape: dict                  # the scrape-time counters at start (``Step.scrape``)


@dataclasses.dataclass
class Step:
    """One iteration's message to the parent."""

    deltas: list                  # [(wire id, Delta)]
    observed: list                # the metric observations, in order (``_Relay``)
    counters: EngineCounters
    new_tokens: int
    lora: LoRAState | None
    scrape: dict | None = None    # the scrape-time counters, at most every SCRAPE_EVERY_S


class _Observer:
    def __init__(self, out: list, name: str):
        self._out, self._name = out, name

    def observe(self, value: float) -> None:
        self._out.append((self._name, value))

    def inc(self, value: float = 1) -> None:
        self._out.append((self._name, value))


class _Relay:
    """Stands in for ``ServerMetrics`` on the engine thread here: what ``EngineLoop`` records
    per request (token latencies, prompt tokens), kept for the parent to replay on its own
    metrics (``process_engine.replay``). A finished request is recorded by the parent, from
    its last delta, which a stop string found there may have cut."""

    def __init__(self):
        self.observed: list = []
        self.ttft = _Observer(self.observed, "ttft")
        self.tpot = _Observer(self.observed, "tpot")
        self.prompt_tokens = _Observer(self.observed, "prompt_tokens")

    def finished(self, timings: dict[str, float], prompt_tokens: int,
                 completion_tokens: int) -> None:
        pass

    def take(self) -> list:
        taken = self.observed[:]
        self.observed.clear()
        return taken


class CoreLoop(LiveEngine):
    """``LiveEngine`` whose streams are the parent's wire ids: commands come from
    ``frames``, outputs and replies go out through ``sender`` (``core_pipe``)."""

    def __init__(self, engine, frames: Iterator[tuple], sender: FrameSender, *,
                 max_waiting: int = 1024):
        super().__init__(engine, max_waiting=max_waiting)
        self._frames = frames
        self._sender = sender
        self.metrics = _Relay()
        self._deltas: list = []
        self._scraped = 0.0

    def handshake(self) -> Handshake:
        tokenizer, eos_ids, no_prompt_logprobs, blank = self.intake_parts()
        return Handshake(self.info, tokenizer, eos_ids, no_prompt_logprobs, blank,
                         dict(self._adapter_registry()), self.engine.startup.line(),
                         self.scrape())

    def send(self, msg: tuple) -> None:
        self._sender.send(msg)

    def close(self) -> None:
        """Returns once everything sent is written (or the parent is gone)."""
        self._sender.close()

    # -- engine thread -------------------------------------------------------------------
    def _stop_at(self, out: list, request_id: str, n_tokens: int) -> None:
        """The parent found a stop string at ``request_id``'s ``n_tokens``-th generated
        token: the request ends there, stopped, its pages freed; its last delta carries the
        usage and timings of those tokens."""
        lv = self._live.get(request_id)
        if lv is None:
            return  # it ended here first: its last delta is on its way
        o = self.core.abort(request_id)
        if o is None:  # (the engine no longer holds it; its stream must still end)
            del self._live[request_id]
            out.append((lv.sink, error_delta(INTERNAL, "the request ended before its stop "
                                                       "string was found")))
            return
        lv.sent_tokens, lv.sent_logprobs = n_tokens, min(lv.sent_logprobs, n_tokens)
        self._delta(out, lv, o.stopped_at(n_tokens), time.monotonic())

    def _publish(self, out: list) -> None:
        self._deltas.extend(out)  # sent with the iteration's counters (``_update_metrics``)

    def _update_metrics(self, new_tokens: int) -> None:
        now = time.monotonic()
        step = Step(self._deltas, self.metrics.take(), self._counters(), new_tokens,
                    self._lora_state())
        self._deltas = []
        if now - self._scraped >= SCRAPE_EVERY_S:
            self._scraped, step.scrape = now, self.scrape()
        self.send(("step", step))

    # -- the child's threads ---------------------------------------------------------------
    async def serve(self) -> None:
        """Runs until the parent says ``shutdown`` (or goes away)."""
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        self.start(loop, on_crash=lambda e: self._crashed(e, done))
        threading.Thread(target=self._read, args=(loop, done), name="jserve-core-reader",
                         daemon=True).start()
        await done.wait()

    def _crashed(self, error: BaseException, done: asyncio.Event) -> None:
        self.send(("crashed", f"engine loop crashed: {error}", self._deltas))
        done.set()

    def _read(self, loop: asyncio.AbstractEventLoop, done: asyncio.Event) -> None:
        name_os_thread()
        try:
            try:
                for msg in self._frames:
                    if self._take(msg, loop):
                        return
            except (EOFError, OSError):
                pass
            self._take(("shutdown", 30.0), loop)  # the parent is gone: end what is in flight
        finally:
            loop.call_soon_threadsafe(done.set)

    def _take(self, msg: tuple, loop: asyncio.AbstractEventLoop) -> bool:
        """Applies one command; True once it was the last."""
        kind = msg[0]
        if kind == "submit":
            _, wire, request_id, prepared, kw = msg
            self.compile_grammar(prepared)  # here, so the engine thread only copies it
            self._cmds.put(lambda out: self._add(out, wire, request_id, prepared, **kw))
        elif kind == "abort":
            self.abort(msg[1])
        elif kind == "stop_at":
            _, request_id, n_tokens = msg
            self._cmds.put(lambda out: self._stop_at(out, request_id, n_tokens))
        elif kind == "max_waiting":
            self.max_waiting = msg[1]  # (read by the engine thread at each add)
        elif kind == "call":
            _, call_id, name, args, kwargs = msg
            if name not in CALLS:
                self.send(("reply", call_id, None, ValueError(f"no such call: {name!r}")))
                return False
            fut = asyncio.run_coroutine_threadsafe(getattr(self, name)(*args, **kwargs), loop)
            fut.add_done_callback(lambda f: self._reply(call_id, f))
        elif kind == "isolated":
            _, call_id, tokens = msg
            self.send(("reply", call_id, self.isolated_prefill_s(tokens), None))
        elif kind == "shutdown":
            self.shutdown(msg[1])
            self.send(("bye",))
            return True
        return False

    def _reply(self, call_id: int, fut) -> None:
        exc = fut.exception()
        self.send(("reply", call_id, None if exc else fut.result(), exc))


def main() -> None:
    """The child's entry point (``python -c ... FD``: the socket to the parent): reads its
    ``EngineSpec``, builds the engine, hands the parent its ``Handshake`` (or why it could not
    start), then serves until told to stop."""
    from jserve.log_setup import configure_logging

    # The parent drains on SIGINT and SIGTERM (a terminal's Ctrl-C reaches both processes)
    # and then says ``shutdown``; this process ends only then, or when the parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    frames, sender = read_frames(sock), FrameSender(sock)
    _, spec = next(frames)
    configure_logging(spec.log_level)
    try:
        core = CoreLoop(build_engine(spec), frames, sender, max_waiting=spec.max_waiting)
        hello = core.handshake()
    except BaseException as e:  # noqa: BLE001 - the parent says why and exits
        log.exception("the engine core could not start")
        sender.send(("failed", f"{type(e).__name__}: {e}"))
        sender.close()
        os._exit(1)
    core.send(("ready", hello))
    asyncio.run(core.serve())
    core.close()
    # The engine thread may still be inside a step it cannot be stopped in, and tearing JAX
    # down takes a while: the requests are ended, so leave now.
    logging.shutdown()
    os._exit(0 if core.crashed is None else 1)

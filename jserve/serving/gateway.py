"""The path of one request through any front end (gRPC, OpenAI HTTP), in one place.

Both front ends run on the same event loop and share one ``Gateway``: it refuses new work
while draining or when the engine thread is gone, validates with the offline API's own checks
(``EngineClient.prepare``, once per request) naming fields the way the caller's
wire format does, hands out request ids that never collide with anyone's (a server id skips
every id in flight, whoever chose it), keeps the set of requests in flight (for the drain),
and turns the engine loop's deltas into a ``Stream`` that counts its request's outcome in
``jserve_requests_total`` exactly once, whatever ends it: a finish, an error from the engine
thread, a cancelled or vanished client, or a passed deadline. The engine is an
``EngineClient`` (``engine_api``): the gateway reads nothing else of it.

Refusals before a request is accepted raise ``Rejected``; the front end maps the kind to its
status code and counts it with ``Gateway.refused``. Tokenization, chat templates and body
parsing run on the gateway's intake threads (``off_loop``), never on the event loop, so one
client's 5 MB prompt does not stall every other client's stream.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import secrets
import time
from typing import Callable, TypeVar

from jserve.fields import FieldError
from jserve.os_threads import name_os_thread
from jserve.sampling.params import SamplingParams
from jserve.serving import engine_api as el
from jserve.serving.auth import bearer_matches
from jserve.serving.engine_api import EngineClient, Prepared
from jserve.serving.limits import ClientLimits, RequestLimits
from jserve.serving.metrics import ServerMetrics

log = logging.getLogger(__name__)

ALREADY_EXISTS = el.ALREADY_EXISTS
UNAUTHENTICATED = "unauthenticated"
NOT_FOUND = el.NOT_FOUND
# A client whose own deadline fired cancels its call a moment before the server's timer
# would: a cancel this close to the deadline counts as deadline_exceeded.
DEADLINE_SLACK_S = 0.25
_PARAM_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
INTAKE_THREADS = 2  # tokenizing requests beside the engine thread and the event loop
T = TypeVar("T")


class Rejected(Exception):
    """A request refused before it reached the engine (``kind``: an engine_api error kind or
    one of this module's; ``field``: the wire's name of the field at fault, if one is)."""

    def __init__(self, kind: str, message: str, field: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.field = field


def invalid(e: FieldError, name: Callable[[str], str] = lambda f: f) -> Rejected:
    """A field's refusal as the wire says it: a ``SamplingParams`` field renamed by ``name``
    (``top_k`` -> ``sampling_params.top_k``), any other as raised."""
    if e.top in _PARAM_FIELDS:
        e = e.renamed(name(e.top))
    return Rejected(el.INVALID, e.message, e.field)


class Gateway:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics,
                 limits: ClientLimits = ClientLimits()):
        self.engine = engine
        self.metrics = metrics
        self.limits = RequestLimits(limits, engine)
        self._intake = concurrent.futures.ThreadPoolExecutor(
            INTAKE_THREADS, thread_name_prefix="jserve-intake", initializer=name_os_thread)
        self.draining = False
        # Shutting down soon (the server's drain notice): /health and the gRPC health check
        # fail so routers stop sending, while requests are still accepted.
        self.leaving = False
        # The open streams by id (a client's id may repeat while the engine refuses it).
        self._in_flight: dict[str, list[Stream]] = {}
        self._drained = asyncio.Event()
        self._drained.set()
        self._nonce = secrets.token_hex(3)
        self._ids = itertools.count()

    # -- before acceptance -------------------------------------------------------------
    def refused(self, kind: str) -> None:
        log.debug("refused before acceptance: %s", kind)
        self.metrics.outcome(kind)

    def check_open(self) -> None:
        if self.draining:
            raise Rejected(el.UNAVAILABLE, "the server is shutting down")
        if not self.engine.alive:
            raise Rejected(el.UNAVAILABLE, "the engine is not running")

    @property
    def healthy(self) -> bool:
        return not (self.draining or self.leaving) and self.engine.alive

    def trusted(self, authorization: str | bytes | None) -> bool:
        """Whether a client's bearer header carries the priority token."""
        token = self.limits.limits.priority_token
        return token is not None and bearer_matches(authorization, token)

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on an intake thread: what may take long per byte of a request."""
        return await asyncio.get_running_loop().run_in_executor(self._intake, fn, *args)

    def prepare(self, prompt: str | list[int], params: SamplingParams, *,
                ttft_slo: float | None = None, tpot_slo: float | None = None,
                priority: int = 0, trusted: bool = False,
                name: Callable[[str], str] = lambda f: f,
                slo_names: tuple[str, str, str] = ("ttft_slo", "tpot_slo", "priority"),
                adapter: str | None = None, adapter_field: str = "model") -> Prepared:
        """The request tokenized and validated (the only time it is) and its SLO fields and
        priority within the server's limits, or ``Rejected`` (INVALID) naming the field as
        ``name`` (``slo_names``) does. ``adapter``: the LoRA adapter it runs with, by name
        (None: the base model), ``Rejected`` NOT_FOUND on ``adapter_field`` when no adapter
        of that name is loaded. Any thread; tokenizes, so not on the event loop."""
        try:
            prepared = (self.engine.prepare(prompt, params) if adapter is None
                        else self.engine.prepare(prompt, params, adapter))
            self.limits.check(len(prepared.prompt_ids), ttft_slo, tpot_slo, priority, trusted,
                              slo_names)
        except FieldError as e:
            if e.top == "model" and adapter is not None:  # no adapter of that name
                e = e.renamed(adapter_field)
                raise Rejected(NOT_FOUND, e.message, e.field) from None
            raise invalid(e, name) from None
        except ValueError as e:  # a refusal of no one field
            raise Rejected(el.INVALID, str(e)) from None
        return prepared

    def new_id(self, prefix: str) -> str:
        """An id no request in flight has, whoever chose it."""
        while True:
            rid = f"{prefix}-{self._nonce}-{next(self._ids)}"
            if rid not in self._in_flight:
                return rid

    def open(self, request_id: str, prepared: Prepared, *,
             arrival: float, deadline: float | None = None, ttft_slo: float | None = None,
             tpot_slo: float | None = None, priority: int = 0) -> Stream:
        """Queues the request on the engine loop. Use as ``async with``: leaving the block
        ends the request. An id the engine holds already is refused there, the one place
        that decides it: the stream's first read raises ``Rejected`` ALREADY_EXISTS."""
        sink = self.engine.submit(request_id, prepared, arrival_time=arrival,
                                  deadline=deadline, ttft_slo=ttft_slo, tpot_slo=tpot_slo,
                                  priority=priority)
        stream = Stream(self, request_id, sink, deadline)
        self._in_flight.setdefault(request_id, []).append(stream)
        self._drained.clear()
        return stream

    # -- drain -------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return sum(map(len, self._in_flight.values()))

    async def wait_drained(self) -> None:
        await self._drained.wait()

    def close(self) -> None:
        self._intake.shutdown(wait=False, cancel_futures=True)

    def end_all(self, kind: str, message: str) -> None:
        """Ends every stream now from the event loop (the engine thread may be stuck in a
        long step): each reader gets ``Rejected(kind)`` at its next read."""
        for s in [s for streams in self._in_flight.values() for s in streams]:
            s._sink.put_nowait(el.Delta([], "", [], error=(kind, message)))

    def _closed(self, stream: Stream) -> None:
        streams = self._in_flight.get(stream.request_id, [])
        if stream in streams:
            streams.remove(stream)
            if not streams:
                del self._in_flight[stream.request_id]
        if not self._in_flight:
            self._drained.set()


class Stream:
    """One accepted request's deltas, one per engine step that produced tokens for it.
    ``await next()`` returns those that piled up (the last list ends with the finish delta,
    then ``done``); an error from the engine raises ``Rejected`` after the deltas before it
    were returned."""

    def __init__(self, gateway: Gateway, request_id: str, sink: asyncio.Queue,
                 deadline: float | None):
        self.gateway = gateway
        self.request_id = request_id
        self._sink = sink
        self._deadline = deadline
        self._error: el.Delta | None = None
        self.outcome: str | None = None  # set once, when counted

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def waiting(self) -> bool:
        """Deltas are queued unread (``next()`` takes them all: any there after it came
        since)."""
        return not self._sink.empty()

    async def next(self) -> list[el.Delta]:
        if self._error is not None:
            self._raise(self._error)
        deltas = [await self._sink.get()]
        while not self._sink.empty() and not deltas[-1].last:
            deltas.append(self._sink.get_nowait())
        last = deltas[-1]
        if last.error is not None:
            if len(deltas) == 1:
                self._raise(last)
            self._error = last
            return deltas[:-1]
        if last.finish_reason is not None:
            self._count(last.finish_reason)
        return deltas

    def _raise(self, d: el.Delta) -> None:
        kind, message = d.error
        self._count(kind)
        raise Rejected(kind, message)

    def _count(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome = outcome
            log.debug("request %r ended: %s", self.request_id, outcome)
            self.gateway.metrics.outcome(outcome)
            self.gateway._closed(self)

    def close(self, outcome: str | None = None) -> None:
        """Ends the request if it has not ended: aborts it on the engine thread (its pages
        are free before the next schedule) and counts it as ``outcome``, by default cancelled,
        or deadline_exceeded when its deadline has (about) passed. Idempotent."""
        if self.outcome is not None:
            return
        self.gateway.engine.abort(self.request_id)
        expired = (self._deadline is not None
                   and time.monotonic() >= self._deadline - DEADLINE_SLACK_S)
        self._count(outcome or (el.DEADLINE if expired else "cancelled"))

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

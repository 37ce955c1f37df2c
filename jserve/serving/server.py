"""The ``jserve.v1.Generation`` gRPC service on ``grpc.aio`` and the process around it.

One event loop runs the gRPC server, the health and reflection services and the request
handlers; the engine (an ``EngineClient``: ``LiveEngine`` over an ``LLMEngine``, or a
``FakeEngine``) runs in its own thread. A handler validates the request with the engine's own
checks (``SamplingParams``, ``EngineClient.prepare``, on an intake thread), submits it, and writes
the request's deltas to the stream as they arrive, coalescing whatever piled up while the
client was slow. A cancelled or disconnected client, or a passed gRPC deadline, aborts the
request on the engine thread at the next iteration.

Status codes: INVALID_ARGUMENT (the field in a ``BadRequest`` detail: ``client.bad_field``,
and named in the message), ALREADY_EXISTS (request_id in
flight), RESOURCE_EXHAUSTED (admission queue full, or a message over ``max_request_bytes``),
DEADLINE_EXCEEDED, UNAVAILABLE (draining or stopped), UNAUTHENTICATED (bearer token), INTERNAL
(engine failure).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import threading
import time

import grpc
from google.protobuf.message import DecodeError
from grpc._cython.cygrpc import ExecuteBatchError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jserve.fields import FieldError
from jserve.proto import generate_pb2 as pb
from jserve.sampling.params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from jserve.serving import engine_api as el
from jserve.serving.auth import bearer_matches
from jserve.serving.edge import EdgeLimits
from jserve.serving.engine_api import EngineClient
from jserve.serving.gateway import (
    ALREADY_EXISTS,
    DEADLINE_SLACK_S,
    UNAUTHENTICATED,
    Gateway,
    Rejected,
    Stream,
    invalid,
)
from jserve.serving.http_server import OpenAIServer
from jserve.serving.limits import ClientLimits
from jserve.serving.live_engine import LiveEngine
from jserve.serving.metrics import ServerMetrics
from jserve.serving.protocol import field_status, logprob_to_proto, parse_request
from jserve.serving.reasoning import FORMATS as REASONING
from jserve.serving.router_endpoints import export_vllm_names
from jserve.serving.tool_formats import DEFAULT_FORMAT, TOOL_FORMATS

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jserve.v1.Generation"
_HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"
_CODES = {el.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
          el.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
          el.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
          el.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
          el.INTERNAL: grpc.StatusCode.INTERNAL,
          ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS}
# How long a call whose read ended with EOF waits to be cancelled before it is answered
# "no GenerateRequest was sent" (only a client that half-closes without a message pays it).
EOF_GRACE_S = 0.5
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"            # loopback; "0.0.0.0" opens every endpoint to the network
    port: int = 50051                  # gRPC; 0: pick a free port (see GenerationServer.port)
    metrics_port: int | None = 9400    # None: no separate /metrics endpoint; 0: a free port
    http_port: int | None = None       # OpenAI-compatible HTTP API; None: off; 0: a free port
    max_waiting: int = 1024            # admission queue; one more gets RESOURCE_EXHAUSTED
    max_request_bytes: int = 4 << 20   # bigger messages: RESOURCE_EXHAUSTED / HTTP 413
    # The HTTP ports' edge (jserve/serving/edge.py), each port on its own: seconds from
    # accept (or a new request's first byte) to a whole request head, the head's size
    # (larger: 431), connections open at once (a request on one more: 503).
    head_timeout: float = 10.0
    max_head_bytes: int = 64 << 10
    max_connections: int = 2048
    grace_period: float = 30.0         # seconds in-flight requests get to finish on SIGTERM
    # Seconds between SIGTERM and the drain during which health checks fail while requests
    # are still served: a router polling /health stops sending before anything is refused.
    drain_notice: float = 0.0
    tls_cert: str | None = None        # PEM files; both or neither
    tls_key: str | None = None
    auth_token: str | None = None      # clients send "authorization: Bearer <token>"
    metrics_open: bool = False         # /metrics without the token even with auth_token
    # The names requests may give in ``model``; the first is the one reported (/v1/models,
    # responses, GetModelInfo.model).
    served_model_names: tuple[str, ...] = ("default",)
    limits: ClientLimits = ClientLimits()  # SLO floors, priorities, choices per request
    # The format the model writes tool calls in (vLLM's --tool-call-parser names).
    tool_call_parser: str = DEFAULT_FORMAT
    # How chat replies' reasoning is told from their answer (vLLM's --reasoning-parser names,
    # ``jserve.serving.reasoning``); None: the reply is all content.
    reasoning_parser: str | None = None
    # The model's default sampling fields for requests that leave them unset, max_tokens
    # also a cap (``jserve.sampling.generation_config``: its generation_config.json).
    sampling_defaults: dict = dataclasses.field(default_factory=dict)

    @property
    def open_to_the_network(self) -> bool:
        """Bound beyond loopback with no bearer token: anyone who can reach it may use it."""
        return self.auth_token is None and self.host not in LOOPBACK

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokens(self) -> tuple[str, ...]:
        """Bearer tokens that may use the server (the priority token is one too)."""
        return tuple(t for t in (self.auth_token, self.limits.priority_token) if t)

    @property
    def metrics_token(self) -> str | None:
        """The token /metrics asks for: the auth token unless ``metrics_open``."""
        return None if self.metrics_open else self.auth_token

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if not self.head_timeout > 0:
            raise ValueError(f"head_timeout must be > 0, got {self.head_timeout}")
        if self.max_head_bytes < 1024:
            raise ValueError(f"max_head_bytes must be >= 1024, got {self.max_head_bytes}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.grace_period < 0:
            raise ValueError(f"grace_period must be >= 0, got {self.grace_period}")
        if not self.drain_notice >= 0:
            raise ValueError(f"drain_notice must be >= 0, got {self.drain_notice}")
        if self.tool_call_parser not in TOOL_FORMATS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_FORMATS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING)} or None, "
                             f"got {self.reasoning_parser!r}")
        names = self.served_model_names
        if isinstance(names, str) or not names or not all(isinstance(n, str) and n
                                                          for n in names):
            raise ValueError(f"served_model_names must be a tuple of names, got {names!r}")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token is empty")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} is not a file")


@dataclasses.dataclass(frozen=True)
class _BadMessage:
    """What the deserializer hands the handler instead of raising (so the client gets
    INVALID_ARGUMENT or RESOURCE_EXHAUSTED, not a bare INTERNAL)."""

    reason: str
    kind: str = el.INVALID


def _tolerant(message_type):
    """A deserializer that hands the handler a ``_BadMessage`` for bytes that are not a
    ``message_type`` (grpc would answer UNKNOWN with a traceback's words)."""
    def deserialize(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return _BadMessage(f"request is not a valid {message_type.DESCRIPTOR.full_name}: "
                               f"{e}")
    return deserialize


_GENERATE_REQUEST = _tolerant(pb.GenerateRequest)


class _BearerAuth(grpc.aio.ServerInterceptor):
    """Every method but health checks needs ``authorization: Bearer <token>``, with one
    of ``tokens``."""

    def __init__(self, tokens: tuple[str, ...], on_denied):
        self._tokens = tokens
        self._on_denied = on_denied

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_HEALTH_PREFIX):
            return handler
        header = dict(details.invocation_metadata or ()).get("authorization")
        if bearer_matches(header, *self._tokens):
            return handler
        self._on_denied()
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""
    msg = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    async def streaming(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class GenerationServer:
    """``await start()``, then ``await stop()`` (drain) or ``wait_for_termination()``.

    One process, one engine, two front ends: the gRPC service and (with
    ``config.http_port``) the OpenAI-compatible HTTP API, both through one ``Gateway``.
    ``engine`` is an ``EngineClient`` (an ``LLMEngine`` is wrapped in a ``LiveEngine``); the
    server starts it in ``start()`` and owns it from then on.
    """

    def __init__(self, engine: EngineClient, config: ServerConfig = ServerConfig()):
        if not isinstance(engine, EngineClient):  # an LLMEngine
            engine = LiveEngine(engine)
        self.engine = engine
        self.config = config
        engine.max_waiting = config.max_waiting
        self.metrics = ServerMetrics()
        engine.attach_metrics(self.metrics)
        export_vllm_names(self.metrics, config.model_name)
        self.gateway = Gateway(engine, self.metrics, config.limits)
        self.calls_in_flight = 0  # Generate handlers running (accepted or not)
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._http = None
        self._openai = None
        info = engine.info
        self._info = pb.ModelInfo(
            model=config.model_name, served_model_names=config.served_model_names,
            vocab_size=info.vocab_size, max_model_len=info.max_model_len,
            eos_token_ids=list(info.eos_token_ids), has_tokenizer=info.has_tokenizer,
            scheduler=info.scheduler, page_size=info.page_size,
            num_kv_blocks=info.num_kv_pages,  # the wire keeps its name
            max_num_seqs=info.max_num_seqs,
            max_logprobs=MAX_LOGPROBS,
            max_stop_strings=MAX_STOP_STRINGS, max_stop_string_chars=MAX_STOP_STRING_CHARS,
            max_stop_token_ids=MAX_STOP_TOKEN_IDS, max_request_bytes=config.max_request_bytes,
            min_tpot_slo=self.gateway.limits.tpot_floor,
            min_ttft_slo=config.limits.min_ttft_slo,
            min_priority=config.limits.priority_range[0],
            max_priority=config.limits.priority_range[1],
            max_choices=config.limits.max_choices)

    @property
    def draining(self) -> bool:
        return self.gateway.draining

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        # The transport refuses (RESOURCE_EXHAUSTED, uncounted) only far past the limit: a
        # message up to it reaches the handler, which counts and refuses it.
        transport_limit = max(4 * cfg.max_request_bytes, 16 << 20)
        interceptors = [_BearerAuth(cfg.tokens, self._denied)] if cfg.auth_token else []
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", transport_limit),
            ("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            # Unary-stream on the wire; registered as stream-stream so that the handler runs
            # (and counts the call) even when it ends before its one message is read.
            "Generate": grpc.stream_stream_rpc_method_handler(
                self._generate_call, request_deserializer=self._deserialize,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self._model_info, request_deserializer=_tolerant(pb.GetModelInfoRequest),
                response_serializer=pb.ModelInfo.SerializeToString),
        }),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert:
            with open(cfg.tls_key, "rb") as k, open(cfg.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"could not bind {address}")
        self.port = port
        self._server = server
        if cfg.http_port is not None:
            self._openai = OpenAIServer(self.gateway, cfg)
            self.http_port = await self._openai.start(cfg.host, cfg.http_port)
        self.start_engine()
        await server.start()
        if cfg.metrics_port is not None:
            self._http = await self.metrics.serve_http(cfg.metrics_port, cfg.host,
                                                       cfg.metrics_token, EdgeLimits.of(cfg))
            self.metrics_port = self._http.port
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s:%d%s", SERVICE, cfg.host, port,
                 f" and the OpenAI API on http://{cfg.host}:{self.http_port}/v1"
                 if self.http_port is not None else "")
        if cfg.open_to_the_network:
            log.warning("OPEN SERVER: bound to %s with no --auth-token: anyone who can reach "
                        "this host can generate and read /metrics", cfg.host)

    async def stop(self, grace: float | None = None, *, hurry: asyncio.Event | None = None
                   ) -> None:
        """Drain (after ``drain_notice`` seconds of failing health checks while still serving):
        refuse new requests (UNAVAILABLE / 503), report NOT_SERVING, give in-flight
        requests ``grace`` seconds (the config's by default; ``hurry`` set cuts it short) to
        finish, then end the rest with UNAVAILABLE and stop, within about half a second of
        the grace period's end however busy the engine thread is."""
        grace = self.config.grace_period if grace is None else grace
        if self.config.drain_notice > 0 and not self.gateway.draining:
            self.gateway.leaving = True  # health fails; requests are still accepted
            await self.health.enter_graceful_shutdown()
            notice = [asyncio.ensure_future(asyncio.sleep(self.config.drain_notice))]
            if hurry is not None:
                notice.append(asyncio.ensure_future(hurry.wait()))
            await asyncio.wait(notice, return_when=asyncio.FIRST_COMPLETED)
            for w in notice:
                w.cancel()
        self.gateway.draining = True
        await self.health.enter_graceful_shutdown()
        if self.gateway.in_flight:
            waits = [asyncio.ensure_future(self.gateway.wait_drained())]
            if hurry is not None:
                waits.append(asyncio.ensure_future(hurry.wait()))
            await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        # The engine thread may be inside a long step (or a compile): end the streams from
        # here, ask it to stop, and wait for it only briefly (it is a daemon thread).
        t0 = time.monotonic()
        log.info("grace over: ending %d requests", self.gateway.in_flight)
        self.gateway.end_all(el.UNAVAILABLE, "the server is shutting down")
        loop = asyncio.get_running_loop()
        stopping = loop.run_in_executor(None, self.engine.shutdown, 0.2)
        await asyncio.sleep(0.05)  # lets the handlers send their statuses
        metrics_stop = (asyncio.ensure_future(self._http.stop(0.2))  # alongside the others
                        if self._http is not None else None)
        if self._openai is not None:
            await self._openai.stop(0.2)
        if self._server is not None:
            await self._server.stop(0.2)
        if metrics_stop is not None:
            await metrics_stop
            self._http = None
        await stopping
        self.gateway.close()
        log.info("stopped %.2f s after the grace period", time.monotonic() - t0)

    def start_engine(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Starts the engine thread alone (``start`` does; Ray's replicas serve without
        ports); if it dies, health turns NOT_SERVING."""
        self.engine.start(loop or asyncio.get_running_loop(), on_crash=self._engine_died)

    def _engine_died(self, error: BaseException) -> None:
        """The engine thread is gone (not a failed step: those are handled): report it."""
        log.error("engine thread died (%s); reporting NOT_SERVING", error)
        for name in ("", SERVICE):
            asyncio.ensure_future(self.health.set(
                name, health_pb2.HealthCheckResponse.NOT_SERVING))

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()

    # -- handlers ----------------------------------------------------------------------
    def _deserialize(self, data: bytes) -> pb.GenerateRequest | _BadMessage:
        limit = self.config.max_request_bytes
        if len(data) > limit:
            return _BadMessage(f"request is {len(data)} bytes; the limit is {limit} bytes "
                               f"(prompt and stop strings count)", el.EXHAUSTED)
        return _GENERATE_REQUEST(data)

    async def _model_info(self, request, context) -> pb.ModelInfo:
        if isinstance(request, _BadMessage):
            await context.abort(_CODES[request.kind], request.reason)
        return self._info

    def _denied(self) -> None:
        self.metrics.grpc_received.inc()
        self.gateway.refused(UNAUTHENTICATED)

    async def _generate_call(self, requests, context) -> None:
        """Every Generate call grpc hands over, counted as received and in
        ``calls_in_flight`` until its handler returns, its outcome counted. A call cancelled or
        expired before grpc hands it over never gets here and counts nowhere."""
        self.metrics.grpc_received.inc()
        self.calls_in_flight += 1
        try:
            await self._generate(requests, context)
        finally:
            self.calls_in_flight -= 1

    async def _accept(self, request, context, arrival: float, deadline: float | None
                      ) -> Stream:
        """Validates (tokenizing off the event loop) and queues the request; ``Rejected`` if
        it is refused."""
        gw = self.gateway
        if isinstance(request, _BadMessage):
            raise Rejected(request.kind, request.reason)
        gw.check_open()
        try:
            parsed = parse_request(request, self.config.sampling_defaults)
        except FieldError as e:
            raise invalid(e) from None
        except ValueError as e:  # a refusal of no one field
            raise Rejected(el.INVALID, str(e)) from None
        trusted = gw.trusted(dict(context.invocation_metadata() or ()).get("authorization"))
        prepared = await gw.off_loop(functools.partial(
            gw.prepare, parsed.prompt, parsed.params, ttft_slo=parsed.ttft_slo,
            tpot_slo=parsed.tpot_slo, priority=parsed.priority, trusted=trusted,
            name=lambda f: f"sampling_params.{f}",
            slo_names=("ttft_slo_seconds", "tpot_slo_seconds", "priority")))
        gw.check_open()  # it may have started draining meanwhile
        rid = parsed.request_id or gw.new_id("grpc")
        return gw.open(rid, prepared, arrival=arrival, deadline=deadline,
                       ttft_slo=parsed.ttft_slo, tpot_slo=parsed.tpot_slo,
                       priority=parsed.priority)

    async def _generate(self, requests, context) -> None:
        arrival = time.monotonic()
        remaining = context.time_remaining()
        deadline = arrival + remaining if remaining is not None else None

        def expired() -> bool:
            return deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S

        try:
            request = await context.read()
            if request is grpc.aio.EOF and not expired():
                # EOF: the client closed its side without a message, or the call ended (a
                # cancel, a dropped connection) and the read saw EOF before the handler was
                # told. grpc tells it by cancelling this task, which under load comes a
                # little after the read, so wait for it before calling the request missing.
                await asyncio.sleep(EOF_GRACE_S)
        except BaseException:  # the call ended (its deadline, a cancel) before its message came
            self.gateway.refused(el.DEADLINE if expired() else "cancelled")
            raise
        if request is grpc.aio.EOF:
            kind = el.DEADLINE if expired() else el.INVALID
            self.gateway.refused(kind)
            await context.abort(_CODES[kind], "no GenerateRequest was sent" if kind == el.INVALID
                                else "the deadline passed before the request was read")
        try:
            stream = await self._accept(request, context, arrival, deadline)
        except Rejected as e:
            self.gateway.refused(e.kind)
            await _abort(context, e)
        except asyncio.CancelledError:  # the call ended while its prompt was tokenized
            self.gateway.refused(el.DEADLINE if expired() else "cancelled")
            raise
        except Exception as e:  # noqa: BLE001 - a bug in intake still ends the call, counted
            log.exception("request intake failed")
            self.gateway.refused(el.INTERNAL)
            await context.abort(_CODES[el.INTERNAL], f"request intake failed: {e}")
        async with stream:
            try:
                while not stream.done:
                    deltas = await stream.next()
                    await context.write(_response(stream.request_id, deltas))
            except Rejected as e:
                await _quietly(_abort(context, e))
            except ExecuteBatchError:
                # The client went away while a message was on its way: the request is
                # cancelled (the block's exit aborts it), and the stream ends quietly.
                raise asyncio.CancelledError from None
            except Exception as e:  # noqa: BLE001 - ours: this call alone ends, INTERNAL
                log.exception("request %s failed", stream.request_id)
                stream.close(el.INTERNAL)
                await _quietly(context.abort(_CODES[el.INTERNAL], f"the request failed: {e}"))


async def _abort(context, e: Rejected) -> None:
    """Ends the call with ``e``'s status, its field (if any) as a ``BadRequest`` detail."""
    code = _CODES[e.kind]
    await context.abort(code, e.message, () if e.field is None else
                        field_status(code.value[0], e.message, e.field))


async def _quietly(abort) -> None:
    """``context.abort`` raises to end the handler; on a call the client already left it
    fails instead (ExecuteBatchError), which grpc would log with a traceback."""
    try:
        await abort
    except ExecuteBatchError:
        raise asyncio.CancelledError from None


def _response(rid: str, deltas: list[el.Delta]) -> pb.GenerateResponse:
    r = pb.GenerateResponse(request_id=rid, text="".join(d.text for d in deltas))
    for d in deltas:
        r.token_ids.extend(d.token_ids)
        r.logprobs.extend(map(logprob_to_proto, d.logprobs))
        if d.prompt_logprobs is not None:  # the first delta's; entry 0 (no context) is None
            r.prompt_logprobs.extend(map(logprob_to_proto, d.prompt_logprobs[1:]))
    last = deltas[-1]
    if last.finish_reason is not None:
        r.finish_reason = _FINISH[last.finish_reason]
        r.usage.prompt_tokens = last.prompt_tokens
        r.usage.completion_tokens = last.completion_tokens
        r.timings.CopyFrom(pb.Timings(**last.timings))
    return r


class BackgroundServer:
    """A GenerationServer on its own event loop in a daemon thread, for embedding (notebooks,
    tests): ``BackgroundServer(engine, config).target`` is ready to dial; ``stop()`` drains."""

    def __init__(self, engine: EngineClient, config: ServerConfig = ServerConfig()):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jserve-grpc",
                                        daemon=True)
        self._thread.start()

        async def create() -> GenerationServer:
            server = GenerationServer(engine, config)
            await server.start()
            return server
        self.server = self.run(create())
        host = "127.0.0.1" if config.host in ("0.0.0.0", "[::]", "") else config.host
        self.target = f"{host}:{self.server.port}"
        self.http_url = (f"http://{host}:{self.server.http_port}"
                         if self.server.http_port is not None else None)

    def run(self, coro, timeout: float | None = None):
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stats(self) -> dict[str, int]:
        return self.run(self.server.engine.stats())

    def stop(self, grace: float | None = None) -> None:
        if self._loop.is_closed():
            return
        self.run(self.server.stop(grace))
        self.server.engine.shutdown()  # the engine is the caller's again once stopped
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def serve(engine: EngineClient, config: ServerConfig, *, ready=None) -> int:
    """Runs until SIGTERM or SIGINT, then drains (a second signal cuts the grace short).
    ``ready(server)`` is called once the ports are bound."""
    server = GenerationServer(engine, config)
    await server.start()
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    if ready is not None:
        ready(server)
    await stop.wait()
    log.info("draining: %d requests in flight, grace %.1f s", server.gateway.in_flight,
             config.grace_period)
    await server.stop(hurry=hurry)
    return 0

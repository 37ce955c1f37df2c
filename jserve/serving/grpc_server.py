"""The ``jserve.v1.Generation`` gRPC service on ``grpc.aio``: a peer of the HTTP API, built
beside it on the same ``Gateway`` and engine by ``jserve.serving.app.Server``.

The server's event loop runs the gRPC server, the health and reflection services and the
request handlers; the engine runs in its own thread. A handler validates the request with
the engine's own checks (``SamplingParams``, ``EngineClient.prepare``, on an intake thread),
submits it, and writes the request's deltas to the stream as they arrive, coalescing
whatever piled up while the client was slow. A cancelled or disconnected client, or a passed
gRPC deadline, aborts the request on the engine thread at the next iteration.

Status codes: INVALID_ARGUMENT (the field in a ``BadRequest`` detail: ``client.bad_field``,
and named in the message), NOT_FOUND (``lora_name`` names no loaded LoRA adapter),
ALREADY_EXISTS (request_id in flight), RESOURCE_EXHAUSTED (admission queue full, or a message
over ``max_request_bytes``), DEADLINE_EXCEEDED, UNAVAILABLE (draining or stopped),
UNAUTHENTICATED (bearer token), INTERNAL (engine failure).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
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
from jserve.serving.gateway import (
    ALREADY_EXISTS,
    DEADLINE_SLACK_S,
    UNAUTHENTICATED,
    Gateway,
    Rejected,
    Stream,
    invalid,
)
from jserve.serving.metrics import ServerMetrics
from jserve.serving.protocol import field_status, logprob_to_proto, parse_request

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jserve.v1.Generation"
_HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"
_CODES = {el.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
          el.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
          el.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
          el.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
          el.INTERNAL: grpc.StatusCode.INTERNAL,
          ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
          el.NOT_FOUND: grpc.StatusCode.NOT_FOUND}
# How long a call whose read ended with EOF waits to be cancelled before it is answered
# "no GenerateRequest was sent" (only a client that half-closes without a message pays it).
EOF_GRACE_S = 0.5
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


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


class GrpcServer:
    """The ``jserve.v1.Generation`` service with health and reflection on ``grpc.aio``: a peer
    of the HTTP API on the same ``Gateway`` (``jserve.serving.app.Server`` builds both).
    ``bind()``, then ``start()``; ``leave()`` fails health checks while serving on; ``stop``."""

    def __init__(self, gateway: Gateway, metrics: ServerMetrics, config):
        self.gateway = gateway
        self.metrics = metrics
        self.config = config
        self.calls_in_flight = 0  # Generate handlers running (accepted or not)
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        info = gateway.engine.info
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
            min_tpot_slo=gateway.limits.tpot_floor,
            min_ttft_slo=config.limits.min_ttft_slo,
            min_priority=config.limits.priority_range[0],
            max_priority=config.limits.priority_range[1],
            max_choices=config.limits.max_choices, max_loras=info.max_loras)

    # -- lifecycle ---------------------------------------------------------------------
    def bind(self) -> int:
        """The server built and its port bound (not yet serving); the port."""
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
        self.port, self._server = port, server
        return port

    async def start(self) -> None:
        await self._server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def leave(self) -> None:
        """Health checks fail from now on (the drain notice, then the drain)."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float) -> None:
        if self._server is not None:
            await self._server.stop(grace)

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
        if gw.engine.info.pooling is not None:
            raise Rejected(el.INVALID, "this server runs an embedding model (--runner "
                                       "pooling): Generate has nothing to generate; use the "
                                       "HTTP API's /v1/embeddings")
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
            slo_names=("ttft_slo_seconds", "tpot_slo_seconds", "priority"),
            adapter=parsed.adapter, adapter_field="lora_name"))
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



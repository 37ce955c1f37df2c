"""The front end's gRPC face (``jserve serve --data-parallel-size N --grpc-port P``): the
``jserve.v1.Generation`` service, each ``Generate`` relayed to the engine the front end's
router picks, its responses passed through as the engine wrote them.

gRPC requests are placed colocated: ``GenerateRequest`` has no field for a KV transfer, so a
prompt is prefilled on the engine that decodes it (the HTTP API disaggregates). The client's
metadata (its bearer token) and deadline go to the engine, which checks them; the engine's
status comes back as is. A call whose engine is gone before its first response is sent to
another (``front.RETRIES``); one that fails later ends with the engine's status.
"""
from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jserve.proto import generate_pb2 as pb
from jserve.serving.engines import Engine
from jserve.serving.front import RETRIES, Front

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_GENERATE, _INFO = f"/{SERVICE}/Generate", f"/{SERVICE}/GetModelInfo"
_FORWARDED = ("authorization",)


class FrontGrpc:
    def __init__(self, front: Front):
        self.front = front
        self.channels: dict[int, grpc.aio.Channel] = {}
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None

    def _channel(self, e: Engine) -> grpc.aio.Channel:
        if e.index not in self.channels:
            self.channels[e.index] = grpc.aio.insecure_channel(e.grpc_target)
        return self.channels[e.index]

    async def start(self, host: str, port: int) -> int:
        """Binds and starts the server; the port bound."""
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate, request_deserializer=pb.GenerateRequest.FromString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(self._model_info),
        }),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"could not bind {host}:{port}")
        await server.start()
        await self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.server = server
        return bound

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(1.0)
        for c in self.channels.values():
            await c.close()

    def _ids(self, request: pb.GenerateRequest) -> list[int]:
        if request.WhichOneof("prompt") == "token_ids":
            return list(request.token_ids.ids)
        return list(self.front.tokenizer.encode(request.text))

    async def _generate(self, request: pb.GenerateRequest, context):
        ids = self._ids(request)
        slo = request.ttft_slo_seconds if request.HasField("ttft_slo_seconds") else None
        metadata = [(k, v) for k, v in context.invocation_metadata() if k in _FORWARDED]
        tried: set[int] = set()
        for _ in range(RETRIES + 1):
            try:
                e, _, _ = self.front.placement(ids, slo, tried, colocated=True)
            except LookupError as err:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
            call = self._channel(e).unary_stream(
                _GENERATE, request_serializer=pb.GenerateRequest.SerializeToString)(
                request, metadata=metadata, timeout=context.time_remaining())
            answered = False
            try:
                async for message in call:  # bytes: passed through as the engine wrote them
                    answered = True
                    yield message
                return
            except grpc.aio.AioRpcError as err:
                if answered or err.code() != grpc.StatusCode.UNAVAILABLE:
                    await context.abort(err.code(), err.details() or "")
                log.warning("%s failed before answering (%s); sending the call again",
                            e.name, err.details())
                tried.add(e.index)
                self.front.retries.inc()
            finally:
                call.cancel()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine could take the request")

    async def _model_info(self, request: bytes, context) -> bytes:
        engines = [e for e in self.front.engines if e.takes_requests and not e.prefills_only]
        if not engines:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine takes requests now")
        metadata = [(k, v) for k, v in context.invocation_metadata() if k in _FORWARDED]
        try:
            return await self._channel(engines[0]).unary_unary(_INFO)(
                request, metadata=metadata, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as err:
            await context.abort(err.code(), err.details() or "")

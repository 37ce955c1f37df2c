"""A small Python client for ``jserve serve`` (no JAX needed).

    from jserve.client import Client
    from jserve import SamplingParams

    with Client("localhost:50051") as c:
        for chunk in c.stream("Hello", SamplingParams(temperature=0, max_tokens=16)):
            print(chunk.text, end="", flush=True)
        done = c.generate([256, 72, 105], SamplingParams(max_tokens=8, seed=1))
        print(done.token_ids, done.finish_reason, done.timings)

``AsyncClient`` is the same on ``grpc.aio``. Failures raise ``grpc.RpcError`` (``.code()`` is
the status, ``.details()`` the message; ``bad_field(error)`` the refused field, as the server's
``BadRequest`` detail names it, e.g. ``sampling_params.top_k``). ``auth_token`` sends
``authorization: Bearer <token>``; ``root_certificates`` (PEM bytes) or ``tls=True`` (system
roots) use TLS.
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from jserve.engine.requests.output import TokenLogprob
from jserve.proto import generate_pb2 as pb, generate_pb2_grpc as pb_grpc
from jserve.sampling.params import SamplingParams
from jserve.serving.protocol import bad_field, build_request, logprob_from_proto

__all__ = ["AsyncClient", "Client", "Completion", "bad_field"]
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclasses.dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None            # 'stop' | 'length'
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float]            # queue_seconds, time_to_first_token, ...
    logprobs: list[TokenLogprob] | None  # when the request asked for them
    # SamplingParams.prompt_logprobs asked: as offline, entry i prompt token i's (0: None)
    prompt_logprobs: list[TokenLogprob | None] | None = None


class _Collector:
    def __init__(self, request: pb.GenerateRequest) -> None:
        asked = request.sampling_params.HasField("prompt_logprobs")
        self.c = Completion("", [], "", None, 0, 0, {}, None, [None] if asked else None)

    def add(self, r: pb.GenerateResponse) -> None:
        c = self.c
        c.request_id = r.request_id
        c.token_ids.extend(r.token_ids)
        c.text += r.text
        if r.logprobs:
            c.logprobs = (c.logprobs or []) + [logprob_from_proto(lp) for lp in r.logprobs]
        if r.prompt_logprobs:  # the first message's
            c.prompt_logprobs += [logprob_from_proto(lp) for lp in r.prompt_logprobs]
        if r.finish_reason:
            c.finish_reason = FINISH_REASONS[r.finish_reason]
            c.prompt_tokens = r.usage.prompt_tokens
            c.completion_tokens = r.usage.completion_tokens
            t = r.timings
            c.timings = dict(queue_seconds=t.queue_seconds,
                             time_to_first_token=t.time_to_first_token,
                             time_per_output_token=t.time_per_output_token,
                             e2e_seconds=t.e2e_seconds)


def _credentials(tls: bool, root_certificates: bytes | None):
    if root_certificates is None and not tls:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


class _Base:
    def __init__(self, target: str, auth_token: str | None):
        self.target = target
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None

    def _request(self, prompt, params, **kw) -> pb.GenerateRequest:
        return prompt if isinstance(prompt, pb.GenerateRequest) else build_request(
            prompt, params, **kw)


class Client(_Base):
    """Blocking client. ``prompt`` is text, token ids or a ready ``GenerateRequest``; keyword
    arguments: ``request_id``, ``priority``, ``ttft_slo``, ``tpot_slo`` (seconds),
    ``lora_name`` (a loaded LoRA adapter to run with; NOT_FOUND if none is)."""

    def __init__(self, target: str, *, auth_token: str | None = None,
                 root_certificates: bytes | None = None, tls: bool = False,
                 options: Sequence[tuple[str, object]] = ()):
        super().__init__(target, auth_token)
        creds = _credentials(tls, root_certificates)
        self.channel = (grpc.secure_channel(target, creds, options=options) if creds
                        else grpc.insecure_channel(target, options=options))
        self.stub = pb_grpc.GenerationStub(self.channel)

    def stream(self, prompt, params: SamplingParams | None = None, *,
               timeout: float | None = None, **kw) -> Iterator[pb.GenerateResponse]:
        """The raw response stream; ``.cancel()`` on the returned call aborts the request."""
        return self.stub.Generate(self._request(prompt, params, **kw), timeout=timeout,
                                  metadata=self._metadata)

    def generate(self, prompt, params: SamplingParams | None = None, *,
                 timeout: float | None = None, **kw) -> Completion:
        request = self._request(prompt, params, **kw)
        col = _Collector(request)
        for r in self.stream(request, timeout=timeout):
            col.add(r)
        return col.c

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout,
                                      metadata=self._metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    """The same on ``grpc.aio`` (create it inside the event loop that uses it)."""

    def __init__(self, target: str, *, auth_token: str | None = None,
                 root_certificates: bytes | None = None, tls: bool = False,
                 options: Sequence[tuple[str, object]] = ()):
        super().__init__(target, auth_token)
        creds = _credentials(tls, root_certificates)
        self.channel = (grpc.aio.secure_channel(target, creds, options=options) if creds
                        else grpc.aio.insecure_channel(target, options=options))
        self.stub = pb_grpc.GenerationStub(self.channel)

    def stream(self, prompt, params: SamplingParams | None = None, *,
               timeout: float | None = None, **kw) -> AsyncIterator[pb.GenerateResponse]:
        return self.stub.Generate(self._request(prompt, params, **kw), timeout=timeout,
                                  metadata=self._metadata)

    async def generate(self, prompt, params: SamplingParams | None = None, *,
                       timeout: float | None = None, **kw) -> Completion:
        request = self._request(prompt, params, **kw)
        col = _Collector(request)
        async for r in self.stream(request, timeout=timeout):
            col.add(r)
        return col.c

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout,
                                            metadata=self._metadata)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

"""Wire messages <-> the offline API's types. No JAX and no engine state: the client uses the
``*_to_proto`` half, the server the ``*_from_proto`` half, and validation stays where it is
(``SamplingParams`` and ``EngineClient.prepare``)."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from jserve import fields
from jserve.engine.requests.output import TokenLogprob
from jserve.proto import generate_pb2 as pb
from jserve.sampling.generation_config import capped
from jserve.sampling.params import SamplingParams
from jserve.sampling.structured import StructuredOutput

# Scalar SamplingParams fields carried as proto3 ``optional`` (unset: the offline default).
SCALAR_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                 "ignore_eos", "logprobs", "speculative", "prompt_logprobs",
                 "skip_special_tokens")
LIST_FIELDS = ("stop", "stop_token_ids")
MAP_FIELDS = ("logit_bias",)
MESSAGE_FIELDS = ("structured_output",)
MAX_REQUEST_ID_CHARS = 256


def field_status(code: int, message: str, field: str) -> tuple[tuple[str, bytes]]:
    """The trailing metadata that carries a refused field as gRPC's rich error model does
    (a ``google.rpc.Status`` with a ``BadRequest`` field violation): a client reads the field
    from ``bad_field``, never from the message."""
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=field, description=message)]))
    status = status_pb2.Status(code=code, message=message, details=[detail])
    return ((rpc_status.GRPC_DETAILS_METADATA_KEY, status.SerializeToString()),)


def bad_field(error) -> str | None:
    """The field a failed call (a ``grpc.RpcError``) was refused for, if it names one."""
    status = rpc_status.from_call(error)
    for detail in status.details if status is not None else ():
        violation = error_details_pb2.BadRequest()
        if detail.Unpack(violation) and violation.field_violations:
            return violation.field_violations[0].field
    return None


def params_from_proto(msg: pb.SamplingParams, defaults: dict | None = None
                      ) -> SamplingParams:
    """Raises ``FieldError`` (SamplingParams' own validation). ``defaults``:
    the server's for fields left unset (``ServerConfig.sampling_defaults``)."""
    defaults = defaults or {}
    kw: dict = {k: v for k, v in defaults.items() if k != "max_tokens"}
    kw.update({name: getattr(msg, name) for name in SCALAR_FIELDS if msg.HasField(name)})
    if "max_tokens" in defaults and "max_tokens" not in kw:  # at least a given min_tokens
        kw["max_tokens"] = max(defaults["max_tokens"], kw.get("min_tokens", 0))
    for name in LIST_FIELDS:
        if len(getattr(msg, name)):
            kw[name] = list(getattr(msg, name))
    for name in MAP_FIELDS:  # as the map itself: SamplingParams counts it before copying
        if len(getattr(msg, name)):
            kw[name] = getattr(msg, name)
    if msg.HasField("structured_output"):
        kw["structured_output"] = structured_from_proto(msg.structured_output)
    return capped(SamplingParams(**kw), defaults)


def structured_from_proto(msg: pb.StructuredOutput) -> StructuredOutput:
    kind = msg.WhichOneof("kind")
    if kind == "json_schema":
        try:
            schema = fields.loads(msg.json_schema, "structured_output.json_schema")
        except ValueError as e:
            raise fields.FieldError("structured_output.json_schema", str(e)) from None
        return StructuredOutput(json=schema)
    if kind == "json_object":
        return StructuredOutput(json=True)
    if kind == "choice":
        return StructuredOutput(choice=list(msg.choice.choices))
    if kind is None:
        raise fields.FieldError("structured_output",
                                "structured_output is empty: set one of its fields")
    return StructuredOutput(**{kind: getattr(msg, kind)})


def structured_to_proto(so: StructuredOutput) -> pb.StructuredOutput:
    if so.json is True:
        return pb.StructuredOutput(json_object=True)
    if so.json is not None:
        return pb.StructuredOutput(json_schema=json.dumps(so.json))
    if so.choice is not None:
        return pb.StructuredOutput(choice=pb.Choices(choices=list(so.choice)))
    return pb.StructuredOutput(**{so.kind: getattr(so, so.kind)})


def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    """Every field, so the server samples exactly as the offline API would."""
    msg = pb.SamplingParams(stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                            logit_bias=dict(p.logit_bias or {}))
    if p.structured_output is not None:
        msg.structured_output.CopyFrom(structured_to_proto(p.structured_output))
    for name in SCALAR_FIELDS:
        value = getattr(p, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                           top_token_ids=[t for t, _ in lp.top],
                           top_logprobs=[v for _, v in lp.top])


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, tuple(zip(msg.top_token_ids,
                                                             msg.top_logprobs)),
                        msg.rank if msg.HasField("rank") else None)


def build_request(prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                  request_id: str = "", priority: int = 0, ttft_slo: float | None = None,
                  tpot_slo: float | None = None, lora_name: str = "") -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, priority=priority, lora_name=lora_name,
                             sampling_params=params_to_proto(params or SamplingParams()))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    if ttft_slo is not None:
        req.ttft_slo_seconds = ttft_slo
    if tpot_slo is not None:
        req.tpot_slo_seconds = tpot_slo
    return req


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    ttft_slo: float | None
    tpot_slo: float | None
    adapter: str | None = None  # lora_name (None: the base model)


def parse_request(req: pb.GenerateRequest, defaults: dict | None = None) -> ParsedRequest:
    """The checks that need no model (``FieldError``, the field named as this wire does); the
    engine's tokenize/validate do the rest.
    ``defaults``: the server's sampling defaults (``params_from_proto``)."""
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise fields.FieldError("request_id", f"request_id must be at most "
                                              f"{MAX_REQUEST_ID_CHARS} chars, got "
                                              f"{len(req.request_id)}")
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise fields.FieldError("prompt", "prompt is empty: set text or token_ids")
    prompt = req.text if kind == "text" else list(req.token_ids.ids)
    try:
        params = params_from_proto(req.sampling_params, defaults)
    except fields.FieldError as e:
        raise e.renamed(f"sampling_params.{e.top}") from None
    slos = {f: getattr(req, f) if req.HasField(f) else None
            for f in ("ttft_slo_seconds", "tpot_slo_seconds")}
    fields.check_slos(*slos.values(), tuple(slos))
    return ParsedRequest(
        request_id=req.request_id, prompt=prompt, params=params,
        priority=fields.number("priority", req.priority), ttft_slo=slos["ttft_slo_seconds"],
        tpot_slo=slos["tpot_slo_seconds"], adapter=req.lora_name or None)

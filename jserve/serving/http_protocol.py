"""The OpenAI HTTP API's wire format: request bodies in, error bodies out (the HTTP side's
``protocol``; no engine state, no event loop), and the request body read within its limit.

Every body field is honoured or refused with a 400 naming it (``PARAMS``); none is dropped.
A request carries at most ``max_choices`` prompts x ``best_of`` (``n`` unless given;
``parse``): each choice run is one engine request, so the cap bounds what one body can put
in the queue.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from starlette import responses

from jserve import fields
from jserve.sampling.params import SamplingParams
from jserve.sampling.structured import STRUCTURED_KINDS, StructuredOutput
from jserve.serving import engine_api as el
from jserve.serving.gateway import NOT_FOUND, UNAUTHENTICATED, Rejected
from jserve.serving.kv_params import TransferParams, parse_transfer_params
from jserve.serving.tool_calls import (
    ToolChoice,
    ToolError,
    check_tool_calls,
    parse_tools,
    template_messages,
)
from jserve.serving.tool_formats import DEFAULT_FORMAT, constraint

# Body fields per endpoint. Sampling fields map to SamplingParams of the same name unless
# noted; the neutral-only ones are accepted only at the value that changes nothing.
_SAMPLING = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
             "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
             "stop_token_ids", "speculative", "logit_bias", "skip_special_tokens")
# vLLM's older spelling of structured_outputs: guided_json is structured_outputs.json, ...
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
_COMMON = {"model", "n", "stream", "stream_options", "max_tokens", "user", "ttft_slo",
           "response_format", "structured_outputs", *GUIDED,
           "tpot_slo", "priority", "kv_transfer_params", *_SAMPLING}
# How a chat becomes its prompt (the chat endpoint's and /tokenize's).
_CHAT_TEMPLATE = {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"}
# Template variables jserve sets itself (chat_template_kwargs may not).
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "continue_final_message")
# Fields routers fill in with their defaults (vllm-router sends every one on every request):
# accepted at the value that is what jserve does anyway. Without a reasoning parser,
# separating or streaming reasoning changes nothing and dropping it cannot be honoured; with
# one (``REASONING_FIELDS``) reasoning can be dropped or left in the content, and it streams
# as it comes.
_ROUTER_FILLED = {"no_stop_trim": (False,), "return_hidden_states": (False,)}
_CHAT_ROUTER_FILLED = {"separate_reasoning": (False, True),
                       "stream_reasoning": (False, True), "include_reasoning": (True,)}
REASONING_FIELDS = {"separate_reasoning": (False, True), "stream_reasoning": (True,),
                    "include_reasoning": (False, True)}
PARAMS = {
    "completions": _COMMON | {"prompt", "logprobs", "echo", "prompt_logprobs", "best_of",
                              "suffix", *_ROUTER_FILLED},
    "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                       "prompt_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                       *_CHAT_TEMPLATE, *_ROUTER_FILLED, *_CHAT_ROUTER_FILLED},
}
# /tokenize (vLLM's TokenizeCompletionRequest or TokenizeChatRequest) and /detokenize.
TOKENIZE_PARAMS = {"model", "prompt", "messages", "add_special_tokens", "tools",
                   "return_token_strs", *_CHAT_TEMPLATE}
DETOKENIZE_PARAMS = {"model", "tokens"}
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
_NEUTRAL = {"suffix": (None, ""), **_ROUTER_FILLED, **_CHAT_ROUTER_FILLED}
# Why a field is accepted only at its neutral value (the 400's message says it).
_WHY_NEUTRAL: dict[str, str] = {}
_STATUS = {el.INVALID: 400, UNAUTHENTICATED: 401, NOT_FOUND: 404, el.EXHAUSTED: 429,
           el.UNAVAILABLE: 503, el.DEADLINE: 504, el.INTERNAL: 500, el.ALREADY_EXISTS: 409}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
         504: "timeout", 500: "server_error"}


class BadField(Rejected):
    """A body refused (400) for ``field`` (None: for no one field)."""

    def __init__(self, field: str | None, message: str):
        super().__init__(el.INVALID, message, field)


class BodyTooLarge(Rejected):
    """A body over ``--max-request-bytes``: 413 (counted resource_exhausted, as gRPC's)."""

    def __init__(self, limit: int):
        super().__init__(el.EXHAUSTED, f"the request body is over this server's limit of "
                                       f"{limit} bytes (--max-request-bytes)")


class JSONResponse(responses.JSONResponse):
    """Starlette's, written as ASCII JSON: a message that echoes a client's lone surrogate
    (valid JSON, ``"\\ud800"``, but not encodable as UTF-8) still goes out, as it came."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_body(kind: str, message: str, field: str | None = None, status: int | None = None
               ) -> tuple[int, dict]:
    status = status or _STATUS[kind]
    kind_of_status = _TYPE.get(status, "invalid_request_error" if status < 500 else
                               "server_error")
    return status, {"error": {"message": message, "type": kind_of_status, "param": field,
                              "code": kind}}


async def send_json(send, status: int, body: dict) -> None:
    """An ASGI response of ``body`` as JSON."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def rejection(e: Rejected) -> tuple[int, dict]:
    """A refusal's status code and body."""
    return error_body(e.kind, e.message, getattr(e, "field", None),
                      413 if isinstance(e, BodyTooLarge) else None)


class ClientGone(Exception):
    """The client disconnected before its request was read."""


async def read_body(scope, receive, limit: int) -> bytes:
    """The request body, or ``BodyTooLarge`` as soon as it is known to be over ``limit``
    bytes: from Content-Length before any of it is read, else once the bytes read pass it.
    Either way at most ``limit`` bytes (plus one chunk) are ever held."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if not value.isdigit():
                raise BadField(None, f"Content-Length {value.decode('latin-1')!r} is not a size")
            if int(value) > limit:
                raise BodyTooLarge(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


# -- request parsing ---------------------------------------------------------------------
@dataclasses.dataclass
class Parsed:
    prompts: list[str | list[int]]
    params: SamplingParams          # for every choice (seed + i for choice i)
    max_tokens_given: bool          # chat: unset max_tokens means "up to the context"
    n: int
    stream: bool
    include_usage: bool             # a last chunk with the request's usage
    continuous_usage: bool          # usage on every chunk too (vLLM's continuous_usage_stats)
    logprobs: int | None
    ttft_slo: float | None
    tpot_slo: float | None
    priority: int
    max_tokens_field: str
    constraint_field: str | None = None  # where the structured output came from
    tools: list[dict] | None = None      # chat: the functions the model may call
    tool_choice: ToolChoice | None = None
    chat: ChatTemplate = dataclasses.field(default_factory=lambda: ChatTemplate())
    echo: bool = False                   # completions: the prompt before each choice's text
    prompt_logprobs: int | None = None   # vLLM's prompt_logprobs field, as asked
    best_of: int = 1                     # choices run per prompt; the n best returned
    reasoning: str | None = None         # chat: the reply's reasoning format, if split
    include_reasoning: bool = True       # the split reasoning is returned (else dropped)
    kv_transfer: TransferParams | None = None  # prefill/decode disaggregation's (kv_params)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """How chat messages are rendered (``jserve.tokenizer.chat_prompt_ids``'s options)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict | None = None   # chat_template_kwargs: extra template variables


def chat_template(body: dict, messages: list[dict]) -> ChatTemplate:
    """``add_generation_prompt`` (default true), ``continue_final_message`` (vLLM's: the last
    message is an assistant's and the reply continues it; then no generation prompt, which
    vLLM makes the client say and jserve implies) and ``chat_template_kwargs``."""
    for field in ("add_generation_prompt", "continue_final_message"):
        if field in body:
            check_kind(body, field, isinstance(body[field], bool), "a bool")
    cont = body.get("continue_final_message", False)
    gen = body.get("add_generation_prompt", not cont)
    if cont:
        if gen:
            raise BadField("continue_final_message", "continue_final_message continues the "
                           "last message, so it cannot go with add_generation_prompt: true")
        last = messages[-1]
        if last["role"] != "assistant" or not last["content"] or last.get("tool_calls"):
            raise BadField("continue_final_message", "continue_final_message needs the last "
                           "message to be an assistant's, with content (and no tool_calls), "
                           "for the reply to continue")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        check_kind(body, "chat_template_kwargs", isinstance(kwargs, dict),
                    "an object (template variable: value)")
        own = [k for k in _TEMPLATE_OWN if k in kwargs]
        if own:
            raise BadField("chat_template_kwargs", f"chat_template_kwargs may not set "
                           f"{own[0]!r}: jserve sets it (give it as its own field)")
    return ChatTemplate(gen, cont, kwargs or None)


@dataclasses.dataclass(frozen=True)
class Tokenize:
    """A ``/tokenize`` body: vLLM's ``TokenizeCompletionRequest`` (``prompt``) or
    ``TokenizeChatRequest`` (``messages``, rendered as the chat endpoint renders them)."""

    prompt: str | None
    messages: list[dict] | None
    add_special_tokens: bool | None   # None: as the completions or chat endpoint would
    chat: ChatTemplate
    tools: list[dict] | None


def body_object(body: Any, allowed: set[str]) -> dict:
    """A body as an object of known fields (nulls dropped), or ``BadField``."""
    if not isinstance(body, dict):
        raise BadField(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadField(unknown[0], f"{unknown[0]} is not supported by jserve")
    body = {k: v for k, v in body.items() if v is not None}
    if "model" in body:
        check_kind(body, "model", isinstance(body["model"], str), "a string")
    return body


def parse_tokenize(body: Any) -> Tokenize:
    body = body_object(body, TOKENIZE_PARAMS)
    if ("prompt" in body) == ("messages" in body):
        raise BadField("prompt", "give prompt (a text) or messages (a chat): one of them")
    for field in ("add_special_tokens", "return_token_strs"):
        if field in body:
            check_kind(body, field, isinstance(body[field], bool), "a bool")
    if body.get("return_token_strs"):
        raise BadField("return_token_strs", "return_token_strs=true is not supported by jserve "
                                            "(decode single ids with /detokenize)")
    special = body.get("add_special_tokens")
    if "prompt" in body:
        chat_only = sorted((_CHAT_TEMPLATE | {"tools"}) & set(body))
        if chat_only:
            raise BadField(chat_only[0], f"{chat_only[0]} goes with messages, not prompt")
        check_kind(body, "prompt", isinstance(body["prompt"], str), "a string")
        return Tokenize(body["prompt"], None, special, ChatTemplate(), None)
    messages = _chat_messages(body)
    tools, _ = _tools(body)
    return Tokenize(None, messages, special, chat_template(body, messages), tools)


def parse_detokenize(body: Any) -> list[int]:
    """A ``/detokenize`` body's ``tokens``."""
    body = body_object(body, DETOKENIZE_PARAMS)
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
        raise BadField("tokens", "tokens must be a list of token ids")
    return tokens


def check_kind(body: dict, field: str, ok: bool, want: str) -> None:
    if not ok:
        raise BadField(field, f"{field} must be {want}, got {fields.shown(body[field])}")


def _check_neutral(body: dict, neutral: dict) -> None:
    """Fields accepted only at the values of ``neutral``: another is a ``BadField``."""
    for field, values in neutral.items():
        if field in body and body[field] not in values:
            why = f": {_WHY_NEUTRAL[field]}" if field in _WHY_NEUTRAL else ""
            raise BadField(field, f"{field}={fields.shown(body[field])} is not supported by "
                                  f"jserve (only {values[-1]!r}){why}")


def parse(body: Any, endpoint: str, max_choices: int = 256,
          tool_format: str = DEFAULT_FORMAT, tokenizer=None, reasoning: str | None = None,
          defaults: dict | None = None) -> Parsed:
    """A request body -> what to run; ``BadField`` naming the field otherwise. The model
    (its ``tokenizer``) writes tool calls in ``tool_format`` (``tool_formats``) and its
    reasoning in ``reasoning``'s format (``jserve.serving.reasoning``; None: no parser).
    ``defaults``: the server's sampling fields for those the body leaves out (the model's
    generation_config.json; their ``max_tokens`` is a cap, applied once the prompt is
    known)."""
    if not isinstance(body, dict):
        raise BadField(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - PARAMS[endpoint])
    if unknown:
        raise BadField(unknown[0], f"{unknown[0]} is not supported by jserve")
    body = {k: v for k, v in body.items() if v is not None}
    reasoning = reasoning if endpoint == "chat" else None
    _check_neutral(body, _NEUTRAL | REASONING_FIELDS if reasoning else _NEUTRAL)
    if "model" not in body:
        raise BadField("model", "model is required")
    check_kind(body, "model", isinstance(body["model"], str), "a string")
    n = body_number(body, "n", 1)
    stream = body.get("stream", False)
    if "stream" in body:
        check_kind(body, "stream", isinstance(stream, bool), "a bool")
    best_of = _best_of(body, n, stream)
    include_usage, continuous_usage = _stream_options(body, stream)
    chat = ChatTemplate()
    if endpoint == "chat":
        prompts = [_chat_messages(body)]
        chat = chat_template(body, prompts[0])
        logprobs = _chat_logprobs(body)
        max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if "max_completion_tokens" in body and "max_tokens" in body:
            raise BadField("max_tokens", "give max_tokens or max_completion_tokens, not both")
    else:
        prompts = body_prompts(body)
        logprobs = body.get("logprobs")
        max_field = "max_tokens"
    if len(prompts) * best_of > max_choices:
        field = "prompt" if len(prompts) > max_choices else "best_of" if best_of > n else "n"
        raise BadField(field, f"{len(prompts)} prompts x {field}={best_of} is over this "
                              f"server's limit of {max_choices} choices per request")
    kw = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
    kw.update({k: body[k] for k in _SAMPLING if k in body})
    constraint_field, kw["structured_output"] = _structured_output(body)
    tools, tool_choice = _tools(body, tool_format) if endpoint == "chat" else (None, None)
    if tools is not None and (c := _tool_constraint(tools, tool_choice, tokenizer)) \
            is not None:
        if constraint_field is not None:
            raise BadField("tool_choice", f"tool_choice={body['tool_choice']!r} constrains the "
                                          f"output: it cannot go with {constraint_field}")
        constraint_field, kw["structured_output"] = "tools", c
    if "stop" in kw and not isinstance(kw["stop"], (str, list)):
        raise BadField("stop", f"stop must be a string or a list of strings, got {kw['stop']!r}")
    if max_field in body:
        kw["max_tokens"] = body[max_field]
    echo, shown_prompt_logprobs, kw["prompt_logprobs"] = _prompt_logprobs(
        body, logprobs if endpoint == "completions" else None)
    ttft_slo, tpot_slo = body_number(body, "ttft_slo"), body_number(body, "tpot_slo")
    priority = body_number(body, "priority", 0)
    if "user" in body:
        check_kind(body, "user", isinstance(body["user"], str), "a string")
    kv = _kv_transfer(body)
    try:
        # best_of > n ranks the choices by their tokens' logprobs: asked for if not given
        # (the response shows them only when the client asked)
        params = SamplingParams(logprobs=0 if logprobs is None and best_of > n else logprobs,
                                **kw)
    except fields.FieldError as e:
        field = wire_field(e.top, max_field, endpoint)
        raise BadField(field, e.renamed(field).message) from None
    except ValueError as e:  # a refusal of no one field
        raise BadField(None, str(e)) from None
    return Parsed(prompts, params, max_field in body, n, stream, include_usage,
                  continuous_usage, logprobs, ttft_slo, tpot_slo, priority, max_field,
                  constraint_field, tools, tool_choice, chat, best_of=best_of, echo=echo,
                  prompt_logprobs=shown_prompt_logprobs,
                  reasoning=reasoning if body.get("separate_reasoning", True) else None,
                  include_reasoning=body.get("include_reasoning", True), kv_transfer=kv)


def _kv_transfer(body: dict):
    """The body's ``kv_transfer_params`` (vLLM's disaggregation fields), or None."""
    if "kv_transfer_params" not in body:
        return None
    try:
        return parse_transfer_params(body["kv_transfer_params"])
    except fields.FieldError as e:
        raise BadField(e.field, e.message) from None


def wire_field(field: str, max_field: str, endpoint: str) -> str:
    """A ``SamplingParams`` field as this body names it: ``max_tokens`` as the body gave its
    length (``max_field``), chat's ``logprobs`` count as ``top_logprobs``."""
    if field == "max_tokens":
        return max_field
    return "top_logprobs" if field == "logprobs" and endpoint == "chat" else field


def _best_of(body: dict, n: int, stream: bool) -> int:
    """``best_of`` (completions): choices run per prompt, >= ``n`` (default ``n``); more
    than ``n`` cannot stream (as OpenAI: the best are known only at the end)."""
    best_of = body_number(body, "best_of", n)
    if best_of < n:
        raise BadField("best_of", f"best_of must be >= n ({n}), got {best_of}")
    if best_of > n and stream:
        raise BadField("best_of", f"best_of={best_of} > n={n} cannot stream: the best "
                                  f"choices are known only once all have finished")
    return best_of


def body_number(body: dict, field: str, default: int | float | None = None
            ) -> int | float | None:
    """A numeric body field checked against ``jserve.fields.NUMBERS`` (``default`` when
    absent)."""
    if field not in body:
        return default
    try:
        return fields.number(field, body[field])
    except fields.FieldError as e:
        raise BadField(field, e.message) from None


def _prompt_logprobs(body: dict, logprobs: int | None) -> tuple[bool, int | None, int | None]:
    """``echo`` (completions: each choice's text starts with the prompt, and its logprobs with
    the prompt's tokens when ``logprobs`` is given) and vLLM's ``prompt_logprobs`` field:
    (echo, prompt_logprobs as asked, the engine's prompt_logprobs: the most either needs; 0
    for an echo of ``max_tokens: 0`` alone, a request only the prompt's prefill serves)."""
    echo = body.get("echo", False)
    if "echo" in body:
        check_kind(body, "echo", isinstance(echo, bool), "a bool")
    shown = body_number(body, "prompt_logprobs")
    valid = isinstance(logprobs, int) and not isinstance(logprobs, bool)  # else refused later
    need = [k for k in (shown, logprobs if echo and valid else None) if k is not None]
    if echo and not need and body.get("max_tokens") == 0:
        need = [0]
    return echo, shown, max(need, default=None)


def _tools(body: dict, fmt: str = DEFAULT_FORMAT
           ) -> tuple[list[dict] | None, ToolChoice | None]:
    try:
        return parse_tools(body, fmt)
    except ToolError as e:
        raise BadField(e.field, str(e)) from None


def _tool_constraint(tools: list[dict], choice: ToolChoice, tokenizer
                     ) -> StructuredOutput | None:
    try:
        return constraint(tools, choice, tokenizer)
    except ToolError as e:
        raise BadField(e.field, str(e)) from None


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """``stream_options``: (include_usage, continuous_usage_stats). vLLM's
    ``continuous_usage_stats`` puts ``usage`` on every chunk; as in vLLM it goes with
    ``include_usage`` (alone it would change nothing there, so it is refused here)."""
    if "stream_options" not in body:
        return False, False
    so = body["stream_options"]
    if not stream:
        raise BadField("stream_options", "stream_options needs stream: true")
    if not isinstance(so, dict) or set(so) - STREAM_OPTIONS:
        raise BadField("stream_options", f"stream_options supports only "
                                         f"{' and '.join(sorted(STREAM_OPTIONS))}, got {so!r}")
    for key in STREAM_OPTIONS:
        if not isinstance(so.get(key, False), bool):
            raise BadField("stream_options", f"stream_options.{key} must be a bool")
    include, continuous = so.get("include_usage", False), so.get("continuous_usage_stats", False)
    if continuous and not include:
        raise BadField("stream_options", "stream_options.continuous_usage_stats needs "
                                         "include_usage: true")
    return include, continuous


def _structured_output(body: dict) -> tuple[str | None, StructuredOutput | None]:
    """OpenAI's ``response_format``, vLLM's ``structured_outputs`` extra or its older
    ``guided_*`` fields (one of them) as a ``StructuredOutput``, with the field it came
    from."""
    if "response_format" in body and "structured_outputs" in body:
        raise BadField("structured_outputs", "give response_format or structured_outputs, "
                                             "not both")
    guided = [f for f in GUIDED if f in body]
    if guided:
        field = guided[0]
        if len(guided) > 1:
            raise BadField(guided[1], f"give one of {', '.join(GUIDED)}, not {guided[0]} and "
                                      f"{guided[1]}")
        other = next((f for f in ("structured_outputs", "response_format") if f in body), None)
        if other is not None:
            raise BadField(field, f"{field} is vLLM's older spelling of structured_outputs: "
                                  f"give {field} or {other}, not both")
        return field, _constraint(field, {GUIDED[field]: body[field]})
    if "response_format" in body:
        rf = body["response_format"]
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "text" and set(rf) == {"type"}:
            return None, None
        if kind == "json_object" and set(rf) == {"type"}:
            return "response_format", StructuredOutput(json=True)
        spec = rf.get("json_schema") if kind == "json_schema" and set(rf) == {
            "type", "json_schema"} else None
        if not (isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict)
                and set(spec) <= {"name", "description", "schema", "strict"}):
            raise BadField("response_format", f"response_format must be {{\"type\": \"text\"}}, "
                           f"{{\"type\": \"json_object\"}} or {{\"type\": \"json_schema\", "
                           f"\"json_schema\": {{\"name\", \"schema\", \"strict\"}}}}, got {rf!r}")
        # strict or not, the schema is enforced: the output always validates.
        return "response_format", StructuredOutput(json=spec.get("schema") or True)
    if "structured_outputs" in body:
        so = body["structured_outputs"]
        if not isinstance(so, dict) or set(so) - set(STRUCTURED_KINDS):
            raise BadField("structured_outputs", f"structured_outputs takes one of "
                                                 f"{list(STRUCTURED_KINDS)}, got {so!r}")
        return "structured_outputs", _constraint("structured_outputs", so)
    return None, None


def constraint_message(wire: str, field: str, message: str) -> str:
    """A ``StructuredOutput`` refusal of ``field`` (``structured_output.regex ...``) as the
    wire ``wire`` names the constraint (``structured_outputs.regex ...``, ``guided_regex
    ...``): renamed by position (a field error's message starts with its field), so text
    inside the message (a pattern that says ``structured_output``) is never rewritten."""
    if wire == "structured_outputs":  # the same field under the wire's top name
        return fields.FieldError(field, message).renamed(wire).message
    if wire in GUIDED:  # one field is the whole constraint
        return wire + message[len(field):] if message.startswith(field) else \
            f"{wire}: {message}"
    return message if message.startswith(wire) else f"{wire}: {message}"


def _constraint(field: str, so: dict) -> StructuredOutput:
    so = dict(so)
    if isinstance(so.get("json"), str):  # vLLM also takes the schema as a JSON string
        try:
            so["json"] = fields.loads(so["json"], f"{field}.json" if field ==
                                      "structured_outputs" else field)
        except ValueError as e:
            raise BadField(field, str(e)) from None
    try:
        return StructuredOutput(**so)
    except ValueError as e:
        wrong = e.field if isinstance(e, fields.FieldError) else "structured_output"
        raise BadField(field, constraint_message(field, wrong, str(e))) from None


def body_prompts(body: dict) -> list[str | list[int]]:
    p = body.get("prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p)):
        return [p]
    if isinstance(p, list) and p and all(
            isinstance(x, str) or (isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x)) for x in p):
        return list(p)
    raise BadField("prompt", "prompt must be a non-empty string, list of token ids, or a "
                             "list of those")


def _chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadField("messages", "messages must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadField(f"messages[{i}]", f"messages[{i}] must be an object with a role")
        extra = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"})
        if extra:
            raise BadField(f"messages[{i}].{extra[0]}",
                           f"messages[{i}].{extra[0]} is not supported by jserve")
        message = {k: m[k] for k in ("name", "tool_call_id") if m.get(k) is not None}
        for k, v in message.items():
            if not isinstance(v, str):
                raise BadField(f"messages[{i}].{k}", f"messages[{i}].{k} must be a string")
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise BadField(f"messages[{i}].tool_calls",
                               f"messages[{i}].tool_calls: only an assistant calls tools")
            try:
                message["tool_calls"] = check_tool_calls(f"messages[{i}]", m["tool_calls"])
            except ToolError as e:
                raise BadField(e.field, str(e)) from None
        content = m.get("content")
        if content is None and "tool_calls" in message:
            content = ""
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text"
                       and isinstance(c.get("text"), str) for c in content):
                raise BadField(f"messages[{i}].content",
                               f"messages[{i}].content: only text parts are supported")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise BadField(f"messages[{i}].content",
                           f"messages[{i}].content must be a string or text parts")
        out.append({"role": m["role"], "content": content, **message})
    return template_messages(out)


def _chat_logprobs(body: dict) -> int | None:
    want = body.get("logprobs", False)
    if not isinstance(want, bool):
        raise BadField("logprobs", f"logprobs must be a bool, got {want!r}")
    if "top_logprobs" in body and not want:
        raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
    return body_number(body, "top_logprobs", 0) if want else None


"""The OpenAI-compatible HTTP API of ``jserve serve`` (Starlette on uvicorn, on the gRPC
server's event loop, through the same ``Gateway`` and engine loop).

``POST /v1/completions`` and ``/v1/chat/completions`` (``stream: true``: server-sent events
ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (503 while draining or once the
engine thread is gone), ``GET /metrics`` (the server's Prometheus registry).

Every body field is honoured or refused with a 400 naming it (``PARAMS``); none is dropped.
Each of a request's ``n`` choices (and each prompt of a batch) is one engine request; the
response starts once every one of them produced its first token (or was refused: 429 when the
admission queue is full), so a refusal still gets its status code. A client that disconnects
cancels the work at once: every engine request is aborted and its KV blocks freed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import time
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jserve.engine.intake import PreparedRequest
from jserve.engine.output import TokenLogprob
from jserve.sampling.params import SamplingParams
from jserve.serving import engine_loop as el
from jserve.serving.gateway import (
    NOT_FOUND,
    UNAUTHENTICATED,
    Gateway,
    Rejected,
    Stream,
    bearer_matches,
    field_message,
)
from jserve.tokenizer import simple_chat_prompt

log = logging.getLogger(__name__)

MAX_N = 16
# Body fields per endpoint. Sampling fields map to SamplingParams of the same name unless
# noted; the neutral-only ones are accepted only at the value that changes nothing.
_SAMPLING = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
             "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
             "stop_token_ids")
_COMMON = {"model", "n", "stream", "stream_options", "max_tokens", "user", "ttft_slo",
           "tpot_slo", "priority", *_SAMPLING}
PARAMS = {
    "completions": _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix", "logit_bias"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                       "logit_bias"},
}
_NEUTRAL = {"echo": (False,), "suffix": (None, ""), "logit_bias": (None, {})}
_STATUS = {el.INVALID: 400, UNAUTHENTICATED: 401, NOT_FOUND: 404, el.EXHAUSTED: 429,
           el.UNAVAILABLE: 503, el.DEADLINE: 504, el.INTERNAL: 500}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         429: "rate_limit_error", 503: "service_unavailable", 504: "timeout", 500: "server_error"}


class BadField(Rejected):
    def __init__(self, field: str, message: str):
        super().__init__(el.INVALID, message)
        self.field = field


def error_body(kind: str, message: str, field: str | None = None) -> tuple[int, dict]:
    status = _STATUS[kind]
    return status, {"error": {"message": message, "type": _TYPE[status], "param": field,
                              "code": kind}}


def _error(e: Rejected) -> JSONResponse:
    status, body = error_body(e.kind, e.message, getattr(e, "field", None))
    return JSONResponse(body, status_code=status)


# -- request parsing ---------------------------------------------------------------------
@dataclasses.dataclass
class Parsed:
    prompts: list[str | list[int]]
    params: SamplingParams          # for every choice (seed + i for choice i)
    max_tokens_given: bool          # chat: unset max_tokens means "up to the context"
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    ttft_slo: float | None
    tpot_slo: float | None
    priority: int
    max_tokens_field: str


def _kind_check(body: dict, field: str, ok: bool, want: str) -> None:
    if not ok:
        raise BadField(field, f"{field} must be {want}, got {body[field]!r}")


def parse(body: Any, endpoint: str) -> Parsed:
    """A request body -> what to run; ``BadField`` naming the field otherwise."""
    if not isinstance(body, dict):
        raise BadField(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - PARAMS[endpoint])
    if unknown:
        raise BadField(unknown[0], f"{unknown[0]} is not supported by jserve")
    body = {k: v for k, v in body.items() if v is not None}
    for field, neutral in _NEUTRAL.items():
        if field in body and body[field] not in neutral:
            raise BadField(field, f"{field}={body[field]!r} is not supported by jserve "
                                  f"(only {neutral[-1]!r})")
    if "model" not in body:
        raise BadField("model", "model is required")
    n = body.get("n", 1)
    _kind_check(body, "n", isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N,
                f"an int in [1, {MAX_N}]") if "n" in body else None
    if "best_of" in body and body["best_of"] != n:
        raise BadField("best_of", f"best_of={body['best_of']!r} is not supported by jserve "
                                  f"(only equal to n)")
    stream = body.get("stream", False)
    if "stream" in body:
        _kind_check(body, "stream", isinstance(stream, bool), "a bool")
    include_usage = False
    if "stream_options" in body:
        so = body["stream_options"]
        if not stream:
            raise BadField("stream_options", "stream_options needs stream: true")
        if not isinstance(so, dict) or set(so) - {"include_usage"}:
            raise BadField("stream_options", f"stream_options supports only include_usage, "
                                             f"got {so!r}")
        include_usage = so.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise BadField("stream_options", "stream_options.include_usage must be a bool")
    if endpoint == "chat":
        prompts = [_chat_messages(body)]
        logprobs = _chat_logprobs(body)
        max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if "max_completion_tokens" in body and "max_tokens" in body:
            raise BadField("max_tokens", "give max_tokens or max_completion_tokens, not both")
    else:
        prompts = _prompts(body)
        logprobs = body.get("logprobs")
        max_field = "max_tokens"
    kw = {k: body[k] for k in _SAMPLING if k in body}
    if "stop" in kw and not isinstance(kw["stop"], (str, list)):
        raise BadField("stop", f"stop must be a string or a list of strings, got {kw['stop']!r}")
    if max_field in body:
        kw["max_tokens"] = body[max_field]
    for field in ("ttft_slo", "tpot_slo"):
        if field in body:
            v = body[field]
            _kind_check(body, field, isinstance(v, (int, float)) and not isinstance(v, bool),
                        "a number of seconds")
    priority = body.get("priority", 0)
    _kind_check(body, "priority", isinstance(priority, int) and not isinstance(priority, bool),
                "an int") if "priority" in body else None
    if "user" in body:
        _kind_check(body, "user", isinstance(body["user"], str), "a string")
    try:
        params = SamplingParams(logprobs=logprobs, **kw)
    except ValueError as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        field = max_field if field == "max_tokens" else field
        if endpoint == "chat" and field == "logprobs":
            field = "top_logprobs"
        raise BadField(field, field_message(message, lambda f: field)) from None
    return Parsed(prompts, params, max_field in body, n, stream, include_usage, logprobs,
                  body.get("ttft_slo"), body.get("tpot_slo"), priority, max_field)


def _prompts(body: dict) -> list[str | list[int]]:
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
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise BadField(f"messages[{i}].{extra[0]}",
                           f"messages[{i}].{extra[0]} is not supported by jserve")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text"
                       and isinstance(c.get("text"), str) for c in content):
                raise BadField(f"messages[{i}].content",
                               f"messages[{i}].content: only text parts are supported")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise BadField(f"messages[{i}].content",
                           f"messages[{i}].content must be a string or text parts")
        out.append({"role": m["role"], "content": content})
    return out


def _chat_logprobs(body: dict) -> int | None:
    want = body.get("logprobs", False)
    if not isinstance(want, bool):
        raise BadField("logprobs", f"logprobs must be a bool, got {want!r}")
    if "top_logprobs" in body and not want:
        raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
    return body.get("top_logprobs", 0) if want else None


# -- responses -----------------------------------------------------------------------------
@dataclasses.dataclass
class Choice:
    index: int
    stream: Stream
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0


class Formatter:
    """Response objects of one endpoint (completions or chat)."""

    def __init__(self, endpoint: str, rid: str, model: str, tokenizer, parsed: Parsed):
        self.chat = endpoint == "chat"
        self.rid, self.model, self.tok, self.parsed = rid, model, tokenizer, parsed
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self._frame: list[str] | None = None

    def _token(self, tid: int) -> str:
        return self.tok.decode([tid]) if self.tok is not None else str(tid)

    def logprobs(self, lps: list[TokenLogprob], offset: int = 0) -> dict | None:
        if self.parsed.logprobs is None:
            return None
        if self.chat:
            def entry(tid, lp):
                s = self._token(tid)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [{**entry(x.token_id, x.logprob),
                                 "top_logprobs": [entry(t, v) for t, v in x.top]}
                                for x in lps]}
        tokens = [self._token(x.token_id) for x in lps]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{self._token(t): v for t, v in x.top} for x in lps],
                "text_offset": offsets}

    def usage(self, choices: list[Choice]) -> dict:
        prompt = sum(c.prompt_tokens for c in choices[::self.parsed.n])
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def full(self, choices: list[Choice]) -> dict:
        out = []
        for c in choices:
            item = {"index": c.index, "finish_reason": c.finish_reason,
                    "logprobs": self.logprobs(c.logprobs)}
            if self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.text
            out.append(item)
        return {"id": self.rid, "object": self.object, "created": self.created,
                "model": self.model, "choices": out, "usage": self.usage(choices)}

    def chunk(self, c: Choice, deltas: list[el.Delta], first: bool) -> dict:
        text = "".join(d.text for d in deltas)
        lps = [lp for d in deltas for lp in d.logprobs]
        finish = deltas[-1].finish_reason if deltas else None
        item: dict = {"index": c.index, "finish_reason": finish,
                      "logprobs": self.logprobs(lps, len(c.text) - len(text))
                      if lps else None}
        if self.chat:
            item["delta"] = ({"role": "assistant", "content": text} if first else
                             {"content": text} if text or not finish else {})
        else:
            item["text"] = text
        return self._wrap([item])

    def chunk_event(self, c: Choice, deltas: list[el.Delta], first: bool) -> bytes:
        """``chunk`` as an SSE event; the common chunk (not the first, no logprobs) is
        spliced into a pre-serialized frame, which keeps the event loop's share of the GIL
        (and so the engine thread's slowdown) small."""
        if first or self.parsed.logprobs is not None:
            return _sse(self.chunk(c, deltas, first))
        if self._frame is None:
            self._frame = json.dumps(self._wrap(["\0"])).split('"\\u0000"')
        text = json.dumps("".join(d.text for d in deltas))
        finish = json.dumps(deltas[-1].finish_reason)
        if self.chat:
            delta = f'{{"content": {text}}}' if text != '""' or finish == "null" else "{}"
            item = f'{{"index": {c.index}, "finish_reason": {finish}, "logprobs": null, ' \
                   f'"delta": {delta}}}'
        else:
            item = f'{{"index": {c.index}, "finish_reason": {finish}, "logprobs": null, ' \
                   f'"text": {text}}}'
        return f"data: {self._frame[0]}{item}{self._frame[1]}\n\n".encode()

    def usage_chunk(self, choices: list[Choice]) -> dict:
        return {**self._wrap([]), "usage": self.usage(choices)}

    def _wrap(self, items: list[dict]) -> dict:
        out = {"id": self.rid, "object": self.object + ("." if self.chat else "") +
               ("chunk" if self.chat else ""), "created": self.created, "model": self.model,
               "choices": items}
        if self.parsed.include_usage:
            out["usage"] = None
        return out


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def _apply(c: Choice, deltas: list[el.Delta]) -> None:
    for d in deltas:
        c.text += d.text
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs
        if d.finish_reason is not None:
            c.finish_reason = d.finish_reason
            c.prompt_tokens = d.prompt_tokens


class _Work:
    """An ASGI response that runs ``work(send)`` until it returns or the client disconnects;
    a disconnect cancels it, and leaving its streams aborts their engine requests."""

    def __init__(self, work):
        self.work = work

    async def __call__(self, scope, receive, send) -> None:
        async def disconnected():
            while (await receive())["type"] != "http.disconnect":
                pass
        task = asyncio.ensure_future(self.work(send))
        watch = asyncio.ensure_future(disconnected())
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        for t in (task, watch):
            t.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not watch.done():
                raise


async def _send_json(send, status: int, body: dict) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


# -- the app ---------------------------------------------------------------------------------
class OpenAIServer:
    def __init__(self, gateway: Gateway, config):
        self.gateway = gateway
        self.config = config
        self.model = config.model_name
        self.app = Starlette(routes=[
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
        ])
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self._generation = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

    async def asgi(self, scope, receive, send) -> None:
        """The app uvicorn runs: the two generation endpoints skip Starlette's middleware, whose
        wrappers would sit on every streamed chunk's ``send``; the rest is the Starlette app
        (which also answers wrong methods and unknown paths)."""
        endpoint = self._generation.get(scope.get("path")) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        response = await self._generate(Request(scope, receive), endpoint)
        await response(scope, receive, send)

    async def start(self, host: str, port: int) -> int:
        """Binds and serves on the running loop; returns the port."""
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
        config = uvicorn.Config(self.asgi, interface="asgi3", log_level="warning",
                                access_log=False, proxy_headers=False,
                                lifespan="off", timeout_graceful_shutdown=0.2,
                                timeout_keep_alive=30, ssl_certfile=self.config.tls_cert,
                                ssl_keyfile=self.config.tls_key)
        self._server = _Uvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"HTTP server on {host}:{port} did not start")
            await asyncio.sleep(0.01)
        return sock.getsockname()[1]

    async def stop(self, timeout: float) -> None:
        if self._server is None:
            return
        self._server.should_exit = self._server.force_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout + 0.2)
        except asyncio.TimeoutError:
            self._task.cancel()

    # -- endpoints -------------------------------------------------------------------------
    def _authorized(self, request: Request) -> None:
        token = self.config.auth_token
        if token is not None and not bearer_matches(request.headers.get("authorization"),
                                                    token):
            raise Rejected(UNAUTHENTICATED, "missing or wrong bearer token "
                                            "(header 'Authorization: Bearer <token>')")

    async def _health(self, request: Request) -> Response:
        gw = self.gateway
        if gw.healthy:
            return JSONResponse({"status": "ok"})
        state = "draining" if gw.draining else "engine stopped"
        return JSONResponse({"status": state}, status_code=503)

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.gateway.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    async def _models(self, request: Request) -> Response:
        try:
            self._authorized(request)
        except Rejected as e:
            self.gateway.refused(e.kind)
            return _error(e)
        eng = self.gateway.engine
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": 0, "owned_by": "jserve",
            "max_model_len": eng.max_model_len, "vocab_size": eng.cfg.vocab_size,
            "scheduler": eng.config.scheduler}]})

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, endpoint: str) -> Response:
        arrival = time.monotonic()
        gw = self.gateway
        try:
            self._authorized(request)
            try:
                body = json.loads(await request.body())
            except ValueError as e:
                raise BadField(None, f"the request body is not JSON: {e}") from None
            parsed = parse(body, endpoint)
            if body["model"] != self.model:
                raise Rejected(NOT_FOUND, f"model {body['model']!r} does not exist; this "
                                          f"server serves {self.model!r}")
            gw.check_open()
            prepared = []
            for p in parsed.prompts:
                text, params = self._prompt(p), parsed.params
                if endpoint == "chat" and not parsed.max_tokens_given:  # up to the context
                    try:
                        text = gw.engine.intake.tokenize(text)[1]  # tokenized once
                    except ValueError as e:
                        raise BadField("messages", str(e)) from None
                    params = dataclasses.replace(
                        params, max_tokens=max(1, gw.engine.max_model_len - len(text),
                                               params.min_tokens))
                prepared.append(self._prepare(text, params, parsed, endpoint))
        except Rejected as e:
            gw.refused(e.kind)
            return _error(e)
        rid = gw.new_id("chatcmpl" if endpoint == "chat" else "cmpl")
        fmt = Formatter(endpoint, rid, self.model, gw.engine.tokenizer, parsed)
        return _Work(lambda send: self._run(send, prepared, parsed, fmt, arrival))

    def _prompt(self, p):
        if isinstance(p, list) and p and isinstance(p[0], dict):  # chat messages
            tok = self.gateway.engine.tokenizer
            if tok is None:
                raise BadField("messages", "this model has no tokenizer, so no chat")
            if getattr(tok, "has_chat_template", True):
                return tok.apply_chat_template(p, add_generation_prompt=True)
            return simple_chat_prompt(p)
        return p

    def _prepare(self, prompt, params: SamplingParams, parsed: Parsed, endpoint: str
                 ) -> PreparedRequest:
        try:
            return self.gateway.prepare(
                prompt, params, ttft_slo=parsed.ttft_slo, tpot_slo=parsed.tpot_slo,
                name=lambda f: parsed.max_tokens_field if f == "max_tokens" else f)
        except Rejected as e:
            field = e.message.split(" ", 1)[0].rstrip(":")
            if field not in PARAMS[endpoint]:
                field = "messages" if endpoint == "chat" else "prompt"
            raise BadField(field, e.message) from None

    async def _run(self, send, prepared, parsed: Parsed, fmt: Formatter, arrival: float
                   ) -> None:
        gw = self.gateway
        choices: list[Choice] = []
        try:
            for request in prepared:
                params = request.params
                for i in range(parsed.n):
                    p = request if params.seed is None or i == 0 else dataclasses.replace(
                        request, params=dataclasses.replace(
                            params, seed=(params.seed + i) % 2**32))
                    s = gw.open(gw.new_id(fmt.rid), p, arrival=arrival,
                                ttft_slo=parsed.ttft_slo, tpot_slo=parsed.tpot_slo,
                                priority=parsed.priority)
                    choices.append(Choice(len(choices), s))
            # The first deltas of every choice decide the status code.
            firsts = await asyncio.gather(*(c.stream.next() for c in choices),
                                          return_exceptions=True)
            for f in firsts:
                if isinstance(f, BaseException):
                    if not isinstance(f, Rejected):
                        raise f
                    status, body = error_body(f.kind, f.message)
                    return await _send_json(send, status, body)
            if parsed.stream:
                await self._stream(send, choices, firsts, fmt)
            else:
                for c, f in zip(choices, firsts):
                    _apply(c, f)
                try:
                    await _pump(choices, lambda c, deltas: _apply(c, deltas))
                except Rejected as e:
                    status, body = error_body(e.kind, e.message)
                    return await _send_json(send, status, body)
                await _send_json(send, 200, fmt.full(choices))
        finally:
            for c in choices:
                c.stream.close()

    async def _stream(self, send, choices: list[Choice], firsts, fmt: Formatter) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})

        async def emit(c: Choice, deltas: list[el.Delta], first: bool = False) -> None:
            _apply(c, deltas)
            await send({"type": "http.response.body", "body": fmt.chunk_event(c, deltas, first),
                        "more_body": True})
        for c, f in zip(choices, firsts):
            await emit(c, f, first=True)
        try:
            await _pump(choices, emit)
            if fmt.parsed.include_usage:
                await send({"type": "http.response.body", "more_body": True,
                            "body": _sse(fmt.usage_chunk(choices))})
        except Rejected as e:
            await send({"type": "http.response.body", "more_body": True,
                        "body": _sse(error_body(e.kind, e.message)[1])})
        await send({"type": "http.response.body", "body": _sse("[DONE]"), "more_body": False})


async def _pump(choices: list[Choice], on_deltas) -> None:
    """Reads every unfinished choice's stream until all are done, calling ``on_deltas(choice,
    deltas)`` (sync or async) in arrival order; the first ``Rejected`` ends it."""
    if len(choices) == 1:  # the common case: no reader task, no queue in between
        c = choices[0]
        while not c.stream.done:
            r = on_deltas(c, await c.stream.next())
            if asyncio.iscoroutine(r):
                await r
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def read(c: Choice) -> None:
        try:
            while not c.stream.done:
                await queue.put((c, await c.stream.next()))
        except Rejected as e:
            await queue.put((c, e))
        await queue.put((c, None))
    readers = [asyncio.ensure_future(read(c)) for c in choices if not c.stream.done]
    try:
        left = len(readers)
        while left:
            c, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Rejected):
                raise item
            else:
                r = on_deltas(c, item)
                if asyncio.iscoroutine(r):
                    await r
    finally:
        for r in readers:
            r.cancel()


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the process's SIGTERM drain owns that."""

    def capture_signals(self):
        import contextlib
        return contextlib.nullcontext()

"""The OpenAI-compatible HTTP API of ``jserve serve`` (Starlette on uvicorn, on the gRPC
server's event loop, through the same ``Gateway`` and engine loop): the HTTP side's
``server``; request bodies are read by ``http_protocol``, responses written by
``http_responses``.

``POST /v1/completions`` and ``/v1/chat/completions`` (``stream: true``: server-sent events
ending in ``data: [DONE]``), ``POST /v1/responses`` (run as the chat completion it means,
``responses_api``) with ``GET``/``DELETE /v1/responses/{id}``, ``GET /v1/models`` and
``/v1/models/{id}`` (and, with LoRA, vLLM's adapter endpoints: ``http_models``; a body's
``model`` may name a loaded adapter), vLLM's ``POST /tokenize`` and ``/detokenize`` and
``GET /version``,
``GET /health`` (503 while draining or once the engine thread is gone), ``GET /metrics`` (the
server's Prometheus registry; behind the bearer token when there is one, unless
``metrics_open``).

The edge is bounded (``edge``: head timeout and size, connections per port): a body over
``max_request_bytes`` gets 413 as soon as that is known (from Content-Length before any of it is
read, else while reading), and the rest is read and dropped, within bounds, so the client reads
the 413 before the connection closes; client JSON is parsed with its numbers and nesting bounded
(``jserve.fields``); a failure of ours in one request ends that request alone with a 500 (or an
error event once streaming); parsing, chat templating and tokenization run on the gateway's
intake threads. Each of a request's ``n`` choices (and each prompt of a batch) is one engine
request; the response starts once every one of them produced its first token (or was refused:
429 when the admission queue is full), so a refusal still gets its status code. A client that
disconnects cancels the work at once: every engine request is aborted and its KV pages freed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import jinja2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jserve import __version__, fields
from jserve.lengths import context_room
from jserve.sampling.generation_config import capped
from jserve.sampling.params import SamplingParams
from jserve.serving import engine_api as el, responses_api as ra
from jserve.serving.auth import bearer_matches
from jserve.serving.edge import EdgeLimits, EdgeServer
from jserve.serving.engine_api import Prepared
from jserve.serving.gateway import NOT_FOUND, UNAUTHENTICATED, Gateway, Rejected
from jserve.serving.http_models import ServedModels
from jserve.serving.http_pooling import PoolingEndpoints
from jserve.serving.http_protocol import (
    PARAMS,
    BadField,
    ChatTemplate,
    ClientGone,
    JSONResponse,
    Parsed,
    constraint_message,
    error_body,
    parse,
    parse_detokenize,
    parse_tokenize,
    read_body,
    rejection,
    send_json,
    wire_field,
)
from jserve.serving.http_responses import (
    Choice,
    Formatter,
    apply_deltas,
    best_choices,
    pump,
    sse,
)
from jserve.serving.kv_connector import KVConnector
from jserve.serving.kv_params import handoff
from jserve.serving.reasoning import FORMATS as REASONING, opens_thinking, thinking_first
from jserve.serving.router_endpoints import RouterEndpoints
from jserve.tokenizer import chat_prompt_ids

log = logging.getLogger(__name__)


def _error(e: Rejected) -> JSONResponse:
    status, body = rejection(e)
    # A body over the limit is not read: the connection ends, after the edge has read and
    # dropped the rest for a while (jserve.serving.edge), so that the client sees the 413.
    return JSONResponse(body, status_code=status,
                        headers={"connection": "close"} if status == 413 else None)


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


# The start of a 200 response of server-sent events (chat and completion streams, Responses').
_EVENTS_START = {"type": "http.response.start", "status": 200, "headers": [
    (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]}


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (an unknown path, a wrong method) in OpenAI's error shape."""
    kind = NOT_FOUND if exc.status_code == 404 else el.INVALID
    status, body = error_body(kind, f"{request.method} {request.url.path}: {exc.detail}",
                              status=exc.status_code)
    return JSONResponse(body, status_code=status, headers=exc.headers)


def _loads(raw: bytes):
    """A body's JSON (numbers and nesting bounded), or ``BadField``."""
    try:
        return fields.loads(raw, "the request body")
    except ValueError as e:
        raise BadField(None, str(e)) from None


# -- the app ---------------------------------------------------------------------------------
class OpenAIServer:
    def __init__(self, gateway: Gateway, config):
        self.gateway = gateway
        self.config = config
        self.model = config.model_name  # what /v1/models and every base response say
        self.models = ServedModels(gateway, config, self._refused)  # what `model` may say
        self.pooling = PoolingEndpoints(gateway, config, self.model, self.models.check)
        self.kv = None if config.kv_transfer is None else KVConnector(gateway,
                                                                      config.kv_transfer, config)
        self.app = Starlette(routes=[
            *self.models.routes,
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/detokenize", self._detokenize, methods=["POST"]),
            Route("/version", self._version, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/v1/responses/{response_id}", self._stored_response,
                  methods=["GET", "DELETE"]),
            *(Route(path, self._pooled, methods=["POST"]) for path in self.pooling.endpoints),
            *RouterEndpoints(gateway, config, self.kv).routes,
            *(self.kv.routes if self.kv is not None else ()),
        ], exception_handlers={HTTPException: _http_error})
        self._edge: EdgeServer | None = None
        self._generation = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
                            "/v1/responses": "responses"}
        self.responses = ra.ResponseStore(config.responses_store_bytes)

    async def asgi(self, scope, receive, send) -> None:
        """The app uvicorn runs: the two generation endpoints skip Starlette (its request
        object and middleware wrappers, which would sit on every streamed chunk's ``send``);
        the rest is the Starlette app (which also answers wrong methods and unknown paths)."""
        endpoint = self._generation.get(scope.get("path")) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            response = JSONResponse(error_body(el.INVALID, "use POST")[1], status_code=405,
                                    headers={"allow": "POST"})
        else:
            response = await self._generate(scope, receive, endpoint)
        if response is not None:
            await response(scope, receive, send)

    async def start(self, host: str, port: int) -> int:
        """Binds and serves on the running loop (behind the bounded edge); returns the
        port."""
        self._edge = EdgeServer(self.asgi, EdgeLimits.of(self.config),
                                ssl_certfile=self.config.tls_cert,
                                ssl_keyfile=self.config.tls_key)
        return await self._edge.start(host, port)

    async def stop(self, timeout: float) -> None:
        if self._edge is not None:
            await self._edge.stop(timeout)
        if self.kv is not None:
            await self.kv.close()

    # -- endpoints -------------------------------------------------------------------------
    def _authorized(self, authorization: str | bytes | None) -> None:
        if self.config.auth_token is not None and not bearer_matches(authorization,
                                                                     *self.config.tokens):
            raise Rejected(UNAUTHENTICATED, "missing or wrong bearer token "
                                            "(header 'Authorization: Bearer <token>')")

    async def _health(self, request: Request) -> Response:
        gw = self.gateway
        if gw.healthy:
            return JSONResponse({"status": "ok"})
        state = "draining" if gw.draining or gw.leaving else "engine stopped"
        return JSONResponse({"status": state}, status_code=503)

    async def _metrics(self, request: Request) -> Response:
        token = self.config.metrics_token
        if token is not None and not bearer_matches(request.headers.get("authorization"),
                                                    token):
            return JSONResponse(error_body(UNAUTHENTICATED, "/metrics needs the bearer token "
                                           "(or the server's --metrics-open)")[1],
                                status_code=401)
        return Response(generate_latest(self.gateway.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    def _refused(self, request: Request) -> Response | None:
        """The 401 of a request without the bearer token (counted), else None."""
        try:
            self._authorized(request.headers.get("authorization"))
        except Rejected as e:
            self.gateway.refused(e.kind)
            return _error(e)
        return None

    async def _version(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        return JSONResponse({"version": __version__})

    async def _stored_response(self, request: Request) -> Response:
        """``GET /v1/responses/{id}``: a stored response; ``DELETE``: forgets it."""
        if (refused := self._refused(request)) is not None:
            return refused
        rid = request.path_params["response_id"]
        if request.method == "DELETE":
            if self.responses.delete(rid):
                return JSONResponse({"id": rid, "object": "response", "deleted": True})
        elif (stored := self.responses.get(rid)) is not None:
            return JSONResponse(stored.response)
        return _error(Rejected(NOT_FOUND, f"no stored response {rid!r}"))

    async def _tokenize(self, request: Request) -> Response:
        return await self._utility(request, self._tokenize_body)

    async def _detokenize(self, request: Request) -> Response:
        return await self._utility(request, self._detokenize_body)

    async def _utility(self, request: Request, handle) -> Response:
        """A POST endpoint that runs no engine request: behind the bearer token, its body read
        within the limit and answered by ``handle(raw, adapters)`` on an intake thread (it
        may tokenize a large body; ``adapters``: the loaded LoRA adapters its ``model`` may
        name)."""
        if (refused := self._refused(request)) is not None:
            return refused
        try:
            raw = await read_body(request.scope, request.receive, self.config.max_request_bytes)
            adapters = await self.models.adapters()
            return JSONResponse(await self.gateway.off_loop(handle, raw, adapters))
        except Rejected as e:
            return _error(e)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - ours, not the client's: 500, and keep serving
            log.exception("%s failed", request.url.path)
            return _error(Rejected(el.INTERNAL, f"{request.url.path} failed: {e}"))

    def _tokenize_body(self, raw: bytes, adapters: dict[str, str]) -> dict:
        """vLLM's ``/tokenize``: a text's ids (with the tokenizer's special tokens unless
        ``add_special_tokens: false``) or a chat's prompt ids exactly as the chat endpoint
        makes them (``add_special_tokens`` given: the rendered text encoded so)."""
        body = _loads(raw)
        t = parse_tokenize(body)
        if "model" in body:  # (an adapter's tokenizer is the base model's)
            self.models.check(body["model"], adapters)
        if t.messages is not None:
            ids = self._prompt(t.messages, t.tools, t.chat, t.add_special_tokens)
        else:
            try:
                ids = self.gateway.engine.tokenize(t.prompt, t.add_special_tokens is not False)
            except fields.FieldError as e:
                raise BadField(e.field, e.message) from None
        return {"count": len(ids), "max_model_len": self.gateway.engine.info.max_model_len,
                "tokens": ids, "token_strs": None}

    def _detokenize_body(self, raw: bytes, adapters: dict[str, str]) -> dict:
        """vLLM's ``/detokenize``: the ids' text, special tokens written out."""
        body = _loads(raw)
        tokens = parse_detokenize(body)
        if "model" in body:  # (an adapter's tokenizer is the base model's)
            self.models.check(body["model"], adapters)
        try:
            return {"prompt": self.gateway.engine.detokenize(tokens)}
        except ValueError as e:
            raise BadField("tokens", f"tokens: {e}") from None

    async def _generate(self, scope, receive, endpoint: str):
        """The ASGI response to a generation request (None: the client left before it was
        read, counted cancelled)."""
        arrival = time.monotonic()
        gw = self.gateway
        admitted = await self._intake(scope, receive, "request", lambda raw, trusted:
                                      self._admit(raw, endpoint, trusted))
        if not isinstance(admitted, tuple):  # refused, or the client left (None)
            return admitted
        parsed, prepared, asked = admitted
        if parsed.kv_transfer is not None and parsed.kv_transfer.do_remote_decode:
            parsed = dataclasses.replace(parsed, kv_transfer=dataclasses.replace(
                parsed.kv_transfer, remote_url=_reached_at(scope)))
        rid = ra.new_id("resp") if asked else gw.new_id(
            "chatcmpl" if endpoint == "chat" else "cmpl")
        # (vLLM's: a response names the adapter it ran with, else the base model)
        model = prepared[0].adapter or self.model if prepared else self.model
        fmt = Formatter("chat" if asked else endpoint, rid, model, gw.engine.tokenizer,
                        parsed)
        return _Work(lambda send: self._run(send, prepared, parsed, fmt, arrival, asked))

    async def _intake(self, scope, receive, what: str, admit):
        """A POST body read within the limit and ``admit(raw, trusted)`` on an intake
        thread: its result (a tuple), or the response of its refusal (counted; a failure of
        ours a 500), or None when the client left first (counted cancelled)."""
        gw = self.gateway
        authorization = dict(scope["headers"]).get(b"authorization")
        try:
            self._authorized(authorization)
            raw = await read_body(scope, receive, self.config.max_request_bytes)
            gw.check_open()
            admitted = await gw.off_loop(admit, raw, gw.trusted(authorization))
            gw.check_open()  # it may have started draining meanwhile
            return admitted
        except Rejected as e:
            gw.refused(e.kind)
            return _error(e)
        except ClientGone:
            gw.refused("cancelled")
            return None
        except Exception as e:  # noqa: BLE001 - ours, not the client's: 500, and keep serving
            log.exception("%s intake failed", what)
            gw.refused(el.INTERNAL)
            return _error(Rejected(el.INTERNAL, f"{what} intake failed: {e}"))

    def _admit(self, raw: bytes, endpoint: str, trusted: bool
               ) -> tuple[Parsed, list[Prepared], ra.Asked | None]:
        """Parses, templates and tokenizes a body (on an intake thread); ``Rejected``
        naming the field. A Responses body is run as the chat body it means
        (``responses_api``), its refusals named as it names its fields."""
        body = _loads(raw)
        if endpoint != "responses":
            return (*self._admit_body(body, endpoint, trusted), None)
        chat, asked = ra.to_chat(body, self.responses)
        try:
            return (*self._admit_body(chat, "chat", trusted), asked)
        except BadField as e:
            raise ra.renamed(e) from None

    def _admit_body(self, body, endpoint: str, trusted: bool
                    ) -> tuple[Parsed, list[Prepared]]:
        if self.gateway.engine.info.pooling is not None:
            raise BadField("model", f"model {self.model!r} is an embedding model (--runner "
                                    f"pooling): it serves /v1/embeddings, not generation")
        parsed = parse(body, endpoint, self.config.limits.max_choices,
                       self.config.tool_call_parser, self.gateway.engine.tokenizer,
                       self.config.reasoning_parser, self.config.sampling_defaults)
        adapter = self.models.adapter_of(body["model"])
        if parsed.kv_transfer is not None:
            if self.kv is None:
                raise BadField("kv_transfer_params", "this engine takes no part in KV "
                                                     "transfers (start it with "
                                                     "--kv-transfer-config)")
            self.kv.check(parsed.kv_transfer)
        prepared, context = [], self.gateway.engine.info.max_model_len
        for p in parsed.prompts:
            prompt, params = self._prompt(p, parsed.tools, parsed.chat), parsed.params
            if endpoint == "chat" and not parsed.max_tokens_given:  # what the context leaves
                params = dataclasses.replace(params, max_tokens=max(
                    1, context_room(len(prompt), context), params.min_tokens))
            params = capped(params, self.config.sampling_defaults)
            if parsed.reasoning is not None and REASONING[parsed.reasoning].keeps_special_tokens:
                params = dataclasses.replace(params, skip_special_tokens=False)  # (markers)
            if parsed.reasoning is not None and params.structured_output is not None:
                params = dataclasses.replace(params, structured_output=thinking_first(
                    REASONING[parsed.reasoning], params.structured_output,
                    opens_thinking(self.gateway.engine.tokenizer, prompt)))
            prepared.append(self._prepare(prompt, params, parsed, endpoint, trusted,
                                          adapter))
        return parsed, prepared

    def _prompt(self, p, tools: list[dict] | None, chat: ChatTemplate,
                add_special_tokens: bool | None = None):
        """A completion prompt as it came; chat messages (and tools) as their prompt ids."""
        if isinstance(p, list) and p and isinstance(p[0], dict):
            tok = self.gateway.engine.tokenizer
            if tok is None:
                raise BadField("messages", "this model has no tokenizer, so no chat")
            try:
                return chat_prompt_ids(
                    tok, p, tools, add_generation_prompt=chat.add_generation_prompt,
                    continue_final_message=chat.continue_final_message,
                    template_kwargs=chat.template_kwargs, add_special_tokens=add_special_tokens)
            except fields.FieldError as e:
                raise BadField(e.field, e.message) from None
            except (jinja2.TemplateError, ValueError, TypeError) as e:
                # (TypeError: a template variable that is a name of render()'s own)
                given = f" (given chat_template_kwargs {sorted(chat.template_kwargs)})" \
                    if chat.template_kwargs else ""
                raise BadField("messages", f"messages: the chat template failed{given}: "
                                           f"{e}") from None
        return p

    def _prepare(self, prompt, params: SamplingParams, parsed: Parsed, endpoint: str,
                 trusted: bool, adapter: str | None = None) -> Prepared:
        try:
            return self.gateway.prepare(
                prompt, params, ttft_slo=parsed.ttft_slo, tpot_slo=parsed.tpot_slo,
                priority=parsed.priority, trusted=trusted,
                name=lambda f: wire_field(f, parsed.max_tokens_field, endpoint),
                adapter=adapter)
        except Rejected as e:
            if e.kind == NOT_FOUND:  # `model` names no loaded adapter
                raise self.models.unknown(adapter) from None
            field, message = e.field or "", e.message
            if field.startswith("structured_output") and parsed.constraint_field:
                message = constraint_message(parsed.constraint_field, field, message)
                field = parsed.constraint_field
            elif field == "prompt_logprobs" and parsed.prompt_logprobs is None:
                field = "echo"  # the engine's prompt logprobs are echo's
            elif field not in PARAMS[endpoint]:
                field = "messages" if endpoint == "chat" else "prompt"
            raise BadField(field, message) from None

    async def _run(self, send, prepared, parsed: Parsed, fmt: Formatter, arrival: float,
                   asked: ra.Asked | None = None) -> None:
        """Runs the accepted request to its response. A failure of ours on the way (in
        output formatting, tool-call parsing, ...) ends this request alone with a 500, or an
        error event once the stream has started, its engine requests aborted and counted
        internal."""
        choices: list[Choice] = []
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = True
            await send(message)
        try:
            await self._respond(tracked, prepared, parsed, fmt, arrival, choices, asked)
        except Exception as e:  # noqa: BLE001 - this request's failure, not the server's
            log.exception("request %s failed", fmt.rid)
            for c in choices:
                c.stream.close(el.INTERNAL)
            status, body = error_body(el.INTERNAL, f"the request failed: {e}")
            if not started:
                return await send_json(send, status, body)
            await send({"type": "http.response.body", "more_body": False,
                        "body": sse(body) + sse("[DONE]")})
        finally:
            for c in choices:
                c.stream.close()

    async def _respond(self, send, prepared, parsed: Parsed, fmt: Formatter, arrival: float,
                       choices: list[Choice], asked: ra.Asked | None) -> None:
        gw = self.gateway
        kv = parsed.kv_transfer
        if kv is not None and kv.do_remote_prefill:  # the prompt's pages first, then run
            for request in prepared:
                await self.kv.pull(kv, request.prompt_ids, request.adapter)
        for request in prepared:
            params = request.params
            for i in range(parsed.best_of):
                p = request if params.seed is None or i == 0 else dataclasses.replace(
                    request, params=dataclasses.replace(
                        params, seed=(params.seed + i) % 2**32))
                s = gw.open(gw.new_id(fmt.rid), p, arrival=arrival,
                            ttft_slo=parsed.ttft_slo, tpot_slo=parsed.tpot_slo,
                            priority=parsed.priority)
                choices.append(Choice(len(choices), s,
                                      prompt_tokens=len(request.prompt_ids),
                                      prompt=request.prompt, prompt_ids=request.prompt_ids))
        # The first deltas of every choice decide the status code.
        firsts = await asyncio.gather(*(c.stream.next() for c in choices),
                                      return_exceptions=True)
        for f in firsts:
            if isinstance(f, BaseException):
                if not isinstance(f, Rejected):
                    raise f
                status, body = error_body(f.kind, f.message)
                return await send_json(send, status, body)
        if asked is not None:
            return await self._respond_responses(send, choices[0], firsts[0], fmt, asked)
        if parsed.stream:
            await self._stream(send, choices, firsts, fmt)
        else:
            for c, f in zip(choices, firsts):
                apply_deltas(c, f)
            try:
                await pump(choices, lambda c, deltas, held: apply_deltas(c, deltas))
            except Rejected as e:
                status, body = error_body(e.kind, e.message)
                return await send_json(send, status, body)
            body = fmt.full(best_choices(choices, parsed), choices)
            if kv is not None and kv.do_remote_decode:  # where the decode engine pulls from
                body["kv_transfer_params"] = handoff(kv.remote_url)
            await send_json(send, 200, body)

    async def _stream(self, send, choices: list[Choice], firsts, fmt: Formatter) -> None:
        await send(_EVENTS_START)

        async def emit(c: Choice, deltas: list[el.Delta], held: bool,
                       first: bool = False) -> None:
            body = fmt.events(c, deltas, held, first)
            if body:  # (empty: text held back as a possible tool call)
                await send({"type": "http.response.body", "more_body": True, "body": body})
        for c, f in zip(choices, firsts):
            await emit(c, f, False, first=True)
        try:
            await pump(choices, emit)
            if fmt.parsed.include_usage:
                await send({"type": "http.response.body", "more_body": True,
                            "body": sse(fmt.usage_chunk(choices))})
        except Rejected as e:
            await send({"type": "http.response.body", "more_body": True,
                        "body": sse(error_body(e.kind, e.message)[1])})
        await send({"type": "http.response.body", "body": sse("[DONE]"), "more_body": False})

    # -- the Responses API (responses_api): the chat reply as a Response ------------------
    async def _respond_responses(self, send, c: Choice, first, fmt: Formatter,
                                 asked: ra.Asked) -> None:
        model, rid, created = fmt.model, fmt.rid, fmt.created
        if not fmt.parsed.stream:
            apply_deltas(c, first)
            try:
                await pump([c], lambda c, deltas, held: apply_deltas(c, deltas))
            except Rejected as e:
                status, body = error_body(e.kind, e.message)
                return await send_json(send, status, body)
            items = ra.output_items(fmt.message(c)[0], c.finish_reason)
            return await send_json(send, 200, self._responded(c, fmt, asked, items))
        writer = ra.EventWriter(ra.response(rid, model, asked, created, "in_progress", [],
                                            None))
        await send(_EVENTS_START)

        async def emit(c: Choice, deltas: list[el.Delta], held: bool, first: bool = False,
                       events: list[dict] | None = None) -> None:
            apply_deltas(c, deltas)
            events = (events or []) + writer.feed(
                fmt.chunk(c, deltas, first)["choices"][0]["delta"])
            if events:
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"".join(map(ra.sse_event, events))})
        await emit(c, first, False, True, writer.begin())
        try:
            await pump([c], emit)
        except Rejected as e:
            error = {"code": e.kind, "message": e.message}
            failed = ra.response(rid, model, asked, created, "failed", writer.items, None)
            events = [writer.event("error", param=None, **error),
                      writer.event("response.failed", response={**failed, "error": error})]
        else:
            events = writer.end(c.finish_reason)
            done = self._responded(c, fmt, asked, writer.items)
            events.append(writer.event(f"response.{done['status']}", response=done))
        await send({"type": "http.response.body", "more_body": False,
                    "body": b"".join(map(ra.sse_event, events))})

    def _responded(self, c: Choice, fmt: Formatter, asked: ra.Asked, items: list[dict]
                   ) -> dict:
        """The finished Response (kept in the store when asked)."""
        out = ra.response(fmt.rid, fmt.model, asked, fmt.created, ra.status_of(c.finish_reason),
                          items,
                          ra.usage(c.prompt_tokens, len(c.token_ids), c.cached_tokens))
        if asked.store and not self.responses.put(
                out, asked.conversation + [ra.reply_message(items)]):
            out["store"] = False  # over the store's bound alone
        return out

    # -- a pooling engine's endpoints (jserve.pooling) -------------------------------------
    async def _pooled(self, request: Request) -> Response:
        """``/v1/embeddings``, ``/v1/score``, ``/v1/rerank`` (``http_pooling``): the body
        admitted on an intake thread, then run; a disconnect aborts it (``_Work``)."""
        admit, respond = self.pooling.endpoints[request.url.path]
        arrival = time.monotonic()
        admitted = await self._intake(request.scope, request.receive, request.url.path,
                                      lambda raw, trusted: admit(_loads(raw), trusted))
        if not isinstance(admitted, tuple):  # refused, or the client left
            return admitted or Response(status_code=499)
        asked, prepared = admitted
        return _Work(lambda send: self.pooling.run(send, asked, prepared, arrival, respond))


def _reached_at(scope) -> str:
    """This server's base URL as the client reached it (its Host header; else the socket's
    address)."""
    host = dict(scope["headers"]).get(b"host")
    if host:
        return f"{scope.get('scheme', 'http')}://{host.decode('latin-1')}"
    addr, port = scope.get("server") or ("127.0.0.1", 0)
    return f"{scope.get('scheme', 'http')}://{addr}:{port}"

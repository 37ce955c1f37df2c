"""What the OpenAI ``model`` field may name, and the endpoints that list and change it.

A body's ``model`` is one of the base model's served names (``--served-model-name``) or,
on an engine with LoRA (``--enable-lora``), the name of a loaded adapter, which the request
then runs with (vLLM's way: one entry of ``/v1/models`` per adapter, ``parent`` the base
model). Anything else is 404, as vLLM's ``The model `x` does not exist``.

- ``GET /v1/models`` and ``/v1/models/{id}``: the base model's card, then one per adapter
  (``root`` its directory, ``parent`` the base model's name), in the order they were loaded.
- With ``--enable-runtime-lora-updating`` only (else 404, as an unknown route), vLLM's
  ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST
  /v1/unload_lora_adapter`` ``{"lora_name"}``: 200 with a text message; 400 naming what is
  wrong with a refused adapter (the engine reads and checks it between steps; requests in
  flight are not disturbed) or for a name loaded already; 404 unloading a name no adapter
  has. Behind the bearer token, as every endpoint.

The adapters are the engine's: loads and unloads run on its thread between steps, and
``EngineClient.adapters`` is what that thread saw after the last one (so listing them never
waits for a step); nothing here keeps a copy of its own.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from jserve import fields
from jserve.serving.engine_api import AdapterNotFound
from jserve.serving.gateway import NOT_FOUND, Gateway, Rejected
from jserve.serving.http_protocol import (
    BadField,
    ClientGone,
    JSONResponse,
    body_object,
    check_kind,
    read_body,
    rejection,
)

LOAD_PARAMS = {"lora_name", "lora_path", "load_inplace"}
UNLOAD_PARAMS = {"lora_name", "lora_int_id"}


def _error(e: Rejected) -> JSONResponse:
    status, body = rejection(e)
    return JSONResponse(body, status_code=status)


class ServedModels:
    """The names a request may give as ``model`` and their routes (``routes``); ``refused``:
    the server's auth check (a request -> its 401 response, or None)."""

    def __init__(self, gateway: Gateway, config, refused):
        self.gateway, self.config, self.refused = gateway, config, refused
        self.model = config.model_name  # what /v1/models and every base response say
        self.names = frozenset(config.served_model_names)
        info = gateway.engine.info
        self.lora = info.lora
        self.routes = [Route("/v1/models", self._models, methods=["GET"]),
                       Route("/v1/models/{model_id:path}", self._model, methods=["GET"])]
        if info.lora and info.runtime_lora_updating:
            self.routes += [Route("/v1/load_lora_adapter", self._load, methods=["POST"]),
                            Route("/v1/unload_lora_adapter", self._unload, methods=["POST"])]

    # -- what `model` names ------------------------------------------------------------------
    def not_found(self, name: str, why: str | None = None) -> Rejected:
        names = ", ".join(map(repr, self.config.served_model_names))
        return Rejected(NOT_FOUND, f"model {name!r} does not exist; this server serves "
                                   f"{names}" + (f", and {why}" if why else ""))

    def unknown(self, name: str) -> Rejected:
        """The 404 of a ``model`` that is neither the base model nor a loaded adapter."""
        return self.not_found(name, f"no LoRA adapter {name!r} is loaded" if self.lora
                              else None)

    def check(self, name: str, adapters: dict[str, str] | None = None) -> None:
        """``Rejected`` NOT_FOUND unless ``name`` is a base model name or one of
        ``adapters`` (the loaded ones, when the caller read them)."""
        if name not in self.names and name not in (adapters or {}):
            raise self.unknown(name)

    def adapter_of(self, name: str) -> str | None:
        """The adapter a body's ``model`` selects (None: the base model). A name that is not
        the base model's is an adapter's, checked when the request is prepared (the
        engine's intake; ``Rejected`` NOT_FOUND there); without LoRA it is refused here."""
        if name in self.names:
            return None
        if not self.lora:
            raise self.not_found(name)
        return name

    async def adapters(self) -> dict[str, str]:
        """The loaded adapters, name -> path ({} without LoRA: no engine round trip)."""
        return await self.gateway.engine.adapters() if self.lora else {}

    # -- /v1/models ----------------------------------------------------------------------------
    def base_card(self) -> dict:
        info, limits = self.gateway.engine.info, self.gateway.limits
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "jserve",
                "root": self.model, "parent": None,
                "max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
                "scheduler": info.scheduler, "min_tpot_slo": limits.tpot_floor,
                "priority_range": list(limits.limits.priority_range),
                "max_choices": limits.limits.max_choices}

    def adapter_card(self, name: str, path: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "jserve",
                "root": path, "parent": self.model,
                "max_model_len": self.gateway.engine.info.max_model_len}

    async def _models(self, request: Request) -> Response:
        if (refused := self.refused(request)) is not None:
            return refused
        cards = [self.base_card()] + [self.adapter_card(n, p)
                                      for n, p in (await self.adapters()).items()]
        return JSONResponse({"object": "list", "data": cards})

    async def _model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: the model object of any served name or loaded adapter,
        else 404."""
        if (refused := self.refused(request)) is not None:
            return refused
        name = request.path_params["model_id"]
        if name in self.names:
            return JSONResponse(self.base_card())
        adapters = await self.adapters()
        if name in adapters:
            return JSONResponse(self.adapter_card(name, adapters[name]))
        return _error(self.unknown(name))

    # -- runtime loading (vLLM's endpoints) ----------------------------------------------------
    async def _body(self, request: Request, allowed: set[str]) -> dict:
        raw = await read_body(request.scope, request.receive, self.config.max_request_bytes)
        try:
            parsed = fields.loads(raw, "the request body")
        except ValueError as e:
            raise BadField(None, str(e)) from None
        body = body_object(parsed, allowed)
        for field in ("lora_name", "lora_path"):
            if field in body:
                check_kind(body, field, isinstance(body[field], str), "a string")
        return body

    async def _load(self, request: Request) -> Response:
        async def load() -> str:
            body = await self._body(request, LOAD_PARAMS)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not name or not path:
                raise BadField("lora_name" if not name else "lora_path",
                               "Both 'lora_name' and 'lora_path' must be provided.")
            if body.get("load_inplace", False) is not False:
                raise BadField("load_inplace", "load_inplace is not supported by jserve "
                                               "(unload the adapter, then load it again)")
            if name in self.names:
                raise BadField("lora_name", f"lora_name {name!r} is the base model's name")
            self.gateway.check_open()
            await self.gateway.engine.load_adapter(name, path)
            return f"Success: LoRA adapter '{name}' added successfully."
        return await self._answered(request, load)

    async def _unload(self, request: Request) -> Response:
        async def unload() -> str:
            body = await self._body(request, UNLOAD_PARAMS)
            if "lora_int_id" in body:
                raise BadField("lora_int_id", "lora_int_id is not supported by jserve (name "
                                              "the adapter by lora_name)")
            name = body.get("lora_name")
            if not name:
                raise BadField("lora_name", "lora_name must be provided")
            self.gateway.check_open()
            await self.gateway.engine.unload_adapter(name)
            return f"Success: LoRA adapter '{name}' removed successfully."
        return await self._answered(request, unload)

    async def _answered(self, request: Request, work) -> Response:
        """``work()``'s success text, or its refusal as vLLM answers it: a bad field 400, an
        adapter nobody loaded 404 (the engine's refusals are its FieldErrors)."""
        if (refused := self.refused(request)) is not None:
            return refused
        try:
            text = await work()
        except AdapterNotFound as e:
            return _error(Rejected(NOT_FOUND, f"{e.args[0]}", "lora_name"))
        except fields.FieldError as e:  # the engine's refusal: the adapter, its name, in use
            return _error(BadField(e.field, e.message))
        except Rejected as e:
            return _error(e)
        except ClientGone:
            return Response(status_code=499)
        return PlainTextResponse(text)

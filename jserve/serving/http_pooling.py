"""The pooling engine's HTTP endpoints (``jserve.pooling``; ``--runner pooling``):
``POST /v1/embeddings`` (OpenAI's), ``/v1/score`` and ``/v1/rerank`` (vLLM's, with its other
paths): bodies in, each input (or text pair) one engine request that ends with its
prefill, the response once all are pooled. ``http_server`` routes them here (its ASGI glue:
auth, body limits, disconnects); the rest is this module's."""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import logging
import time
from typing import Any

from jserve import pooling
from jserve.pooling import POOLED, finish, score, unserved
from jserve.serving import engine_api as el
from jserve.serving.engine_api import Prepared
from jserve.serving.gateway import Gateway, Rejected
from jserve.serving.http_protocol import (
    BadField,
    body_number,
    body_object,
    body_prompts,
    check_kind,
    error_body,
    send_json,
)

log = logging.getLogger(__name__)

# /v1/embeddings (OpenAI's fields, and the SLO fields every engine request takes).
EMBEDDINGS_PARAMS = {"model", "input", "encoding_format", "dimensions", "user", "ttft_slo",
                     "priority"}
# vLLM's /v1/score and /v1/rerank (cross-encoders).
SCORE_PARAMS = {"model", "text_1", "text_2", "user", "ttft_slo", "priority"}
RERANK_PARAMS = {"model", "query", "documents", "top_n", "return_documents", "user",
                 "ttft_slo", "priority"}


@dataclasses.dataclass(frozen=True)
class Embed:
    """A ``/v1/embeddings`` body."""

    model: str
    inputs: list[str | list[int]]
    base64: bool                # encoding_format "base64" (float32, little-endian)
    dimensions: int | None
    ttft_slo: float | None
    priority: int


def parse_embeddings(body: Any, max_choices: int) -> Embed:
    """A ``/v1/embeddings`` body; ``BadField`` naming the field. ``input``: a text, token ids,
    or a list of either, at most ``max_choices`` of them (each is one engine request)."""
    body = body_object(body, EMBEDDINGS_PARAMS)
    if "model" not in body:
        raise BadField("model", "model is required")
    try:
        inputs = body_prompts({"prompt": body.get("input")})
    except BadField:
        raise BadField("input", "input must be a non-empty string, a list of token ids, or a "
                                "list of those") from None
    if any(len(x) == 0 for x in inputs):
        raise BadField("input", "input must not hold an empty string or list")
    if len(inputs) > max_choices:
        raise BadField("input", f"{len(inputs)} inputs are over this server's limit of "
                                f"{max_choices} per request")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise BadField("encoding_format", f"encoding_format must be float or base64, got "
                                          f"{fmt!r}")
    if "user" in body:
        check_kind(body, "user", isinstance(body["user"], str), "a string")
    return Embed(body["model"], inputs, fmt == "base64", body_number(body, "dimensions"),
                 body_number(body, "ttft_slo"), body_number(body, "priority", 0))


@dataclasses.dataclass(frozen=True)
class Score:
    """A ``/v1/score`` or ``/v1/rerank`` body: the text pairs a cross-encoder scores."""

    model: str
    pairs: list[tuple[str, str]]
    field: str                  # where a pair's refusal points: text_2 or documents
    ttft_slo: float | None
    priority: int
    top_n: int | None = None    # rerank: the best this many (None: all)
    documents: bool = True      # rerank: each result carries its document's text


def _texts(body: dict, field: str, one: bool = False) -> list[str]:
    v = body.get(field)
    ok = isinstance(v, str) if one else (
        isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(x, str)
                                                                 for x in v)))
    if not ok:
        raise BadField(field, f"{field} must be a string" + ("" if one else
                                                             " or a non-empty list of them"))
    return [v] if isinstance(v, str) else list(v)


def _scored(body: dict, pairs: list, field: str, max_choices: int, **extra) -> Score:
    if "model" not in body:
        raise BadField("model", "model is required")
    if len(pairs) > max_choices:
        raise BadField(field, f"{len(pairs)} pairs are over this server's limit of "
                              f"{max_choices} per request")
    if "user" in body:
        check_kind(body, "user", isinstance(body["user"], str), "a string")
    return Score(body["model"], pairs, field, body_number(body, "ttft_slo"),
                 body_number(body, "priority", 0), **extra)


def parse_score(body: Any, max_choices: int) -> Score:
    """vLLM's ``/v1/score``: ``text_1`` with each ``text_2``, or each with its own."""
    body = body_object(body, SCORE_PARAMS)
    try:
        pairs = pooling.pairs(_texts(body, "text_1"), _texts(body, "text_2"))
    except ValueError as e:
        raise BadField("text_1", str(e)) from None
    return _scored(body, pairs, "text_2", max_choices)


def parse_rerank(body: Any, max_choices: int) -> Score:
    """vLLM's (and Cohere's) ``/v1/rerank``: ``query`` scored with each of ``documents``."""
    body = body_object(body, RERANK_PARAMS)
    query = _texts(body, "query", one=True)[0]
    documents = body.get("documents")
    if not (isinstance(documents, list) and documents and all(
            isinstance(d, str) for d in documents)):
        raise BadField("documents", "documents must be a non-empty list of strings")
    top_n = body_number(body, "top_n") if "top_n" in body else None
    if "return_documents" in body:
        check_kind(body, "return_documents", isinstance(body["return_documents"], bool),
                    "a bool")
    return _scored(body, [(query, d) for d in documents], "documents", max_choices,
                   top_n=top_n or None, documents=body.get("return_documents", True))


class PoolingEndpoints:
    """The endpoints' logic for ``OpenAIServer`` (``endpoints``: path -> (admit, respond)).
    ``check_model``: the server's check of a body's ``model``."""

    def __init__(self, gateway: Gateway, config, model: str, check_model):
        self.gateway, self.config, self.model, self.check_model = (
            gateway, config, model, check_model)
        score_it = (functools.partial(self.admit_pairs, parse_score), self.scored)
        rerank = (functools.partial(self.admit_pairs, parse_rerank), self.reranked)
        self.endpoints = {"/v1/embeddings": (self.admit_embeddings, self.embedded),
                          "/v1/score": score_it, "/score": score_it, "/v1/rerank": rerank,
                          "/rerank": rerank, "/v2/rerank": rerank}

    async def run(self, send, asked, prepared: list[Prepared], arrival: float, respond
                  ) -> None:
        """Each request's last delta once all are pooled, then ``respond(asked, deltas)``'s
        body, or the first refusal's error."""
        gw = self.gateway
        streams = [gw.open(gw.new_id("pool"), p, arrival=arrival, ttft_slo=asked.ttft_slo,
                           priority=asked.priority) for p in prepared]

        async def last(s) -> el.Delta:
            while True:
                for d in await s.next():
                    if d.last:
                        return d
        try:
            ends = await asyncio.gather(*(last(s) for s in streams))
            body = respond(asked, ends)
        except Rejected as e:
            status, body = error_body(e.kind, e.message)
            return await send_json(send, status, body)
        except Exception as e:  # noqa: BLE001 - this request's failure, not the server's
            log.exception("a pooling request failed")
            status, body = error_body(el.INTERNAL, f"the request failed: {e}")
            return await send_json(send, status, body)
        finally:
            for s in streams:
                s.close()
        tokens = sum(d.prompt_tokens for d in ends)
        await send_json(send, 200, {
            "id": gw.new_id("pool"), "created": int(time.time()), "model": self.model, **body,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _pooling_model(self, scores: bool) -> None:
        """``BadField`` ("model") unless this engine makes embeddings (``scores``: is a
        one-label cross-encoder; ``pooling.unserved``)."""
        info = self.gateway.engine.info
        why = unserved(info.pooling, info.num_labels, scores)
        if why is not None:
            raise BadField("model", f"model {self.model!r}: {why}")

    def admit_embeddings(self, body, trusted: bool) -> tuple[Embed, list[Prepared]]:
        asked = parse_embeddings(body, self.config.limits.max_choices)
        self.check_model(asked.model)
        self._pooling_model(scores=False)
        info = self.gateway.engine.info
        if asked.dimensions is not None and (
                why := info.pooling.check_dimensions(asked.dimensions, info.hidden_size)):
            raise BadField("dimensions", why)
        return asked, self._prepare_pooled(asked.inputs, asked, "input", trusted)

    def admit_pairs(self, parse_body, body, trusted: bool) -> tuple[Score, list[Prepared]]:
        asked = parse_body(body, self.config.limits.max_choices)
        self.check_model(asked.model)
        self._pooling_model(scores=True)
        encode = getattr(self.gateway.engine.tokenizer, "encode_pair", None)
        if encode is None:
            raise BadField("model", f"model {self.model!r} has no tokenizer.json to join text "
                                    f"pairs with")
        return asked, self._prepare_pooled([encode(a, b) for a, b in asked.pairs], asked,
                                           asked.field, trusted)

    def _prepare_pooled(self, prompts: list, asked, field: str, trusted: bool
                        ) -> list[Prepared]:
        """Each prompt as a pooling request; a refusal names ``field`` (its SLO fields
        their own), with the prompt's index when there are several."""
        out = []
        for i, x in enumerate(prompts):
            try:
                out.append(self.gateway.prepare(x, POOLED, ttft_slo=asked.ttft_slo,
                                                priority=asked.priority, trusted=trusted))
            except Rejected as e:
                name = e.field if e.field in ("ttft_slo", "priority") else field
                where = f"{field}[{i}]: " if len(prompts) > 1 else ""
                raise BadField(name, where + e.message) from None
        return out

    def embedded(self, asked: Embed, ends: list[el.Delta]) -> dict:
        spec, data = self.gateway.engine.info.pooling, []
        for i, d in enumerate(ends):
            v = finish(d.embedding, spec, asked.dimensions)
            data.append({"object": "embedding", "index": i, "embedding": base64.b64encode(
                v.astype("<f4").tobytes()).decode() if asked.base64 else v.tolist()})
        return {"object": "list", "data": data}

    def scored(self, asked: Score, ends: list[el.Delta]) -> dict:
        spec = self.gateway.engine.info.pooling
        return {"object": "list", "data": [{"index": i, "object": "score",
                                            "score": score(d.embedding, spec)}
                                           for i, d in enumerate(ends)]}

    def reranked(self, asked: Score, ends: list[el.Delta]) -> dict:
        spec = self.gateway.engine.info.pooling
        results = sorted(({"index": i, "relevance_score": score(d.embedding, spec),
                           **({"document": {"text": asked.pairs[i][1]}} if asked.documents
                              else {})} for i, d in enumerate(ends)),
                         key=lambda r: -r["relevance_score"])
        return {"results": results[:asked.top_n]}

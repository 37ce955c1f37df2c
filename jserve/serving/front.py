"""The front end of ``jserve serve --data-parallel-size N``: one OpenAI-compatible HTTP port
in front of N engine processes (``jserve.serving.engines``), each request placed on an engine
by the deadline-aware router (gRPC: ``front_grpc``, on the same placement). No JAX here: the
front end only reads prompts and reports.

**Placement.** Each completions or chat request's prompt is read (the model's tokenizer;
``route_prompt``) and placed from the engines' ``/v1/route/load`` reports, polled every
``engines.POLL_S``, plus what was sent since (``jserve.routing.sent``), with prefix hits
guessed from where earlier prompts went (``PrefixMemory``). With prefill engines
(``--prefill-engines``), ``jserve.routing.disagg.place`` decides per request, by deadline,
whether the prompt is prefilled colocated (chunked, on the decode engine) or on a prefill
engine whose pages then go to the decode engine (``--disaggregation auto``; ``always`` or
``never`` force it). Without them, ``jserve.routing.choose`` picks the engine
(``--front-router``).

**Disaggregated requests** go to the prefill engine first as the same body with
``max_tokens: 1`` (not streamed), then to the decode engine with ``kv_transfer_params``
``{"do_remote_prefill": true, "remote_url": PREFILL}``: the decode engine pulls the pages
(``kv_connector``) and computes only what did not arrive. If the prefill engine fails, the
request runs colocated on the decode engine (nothing has been sent to the client yet).

**The Responses API** (``/v1/responses``) is placed too, colocated; a response's id is
remembered with the engine that made it, so a ``previous_response_id`` and ``GET``/``DELETE``
``/v1/responses/{id}`` go there (stored responses stay where they were made; an engine's
die with it).

**Faults.** A request whose engine fails before its response started (the connection
refused or dropped, the engine gone) is sent to another engine, at most ``RETRIES`` times;
one that fails mid-stream gets an error event (``type`` unavailable) and ``[DONE]``, so
every accepted request ends with its result or an explicit status. The engine is taken out
once its process ends or it misses polls for ``engines.DEAD_AFTER_S``.

**Endpoints of its own.** ``GET /health`` (200 while an engine takes requests),
``GET /metrics`` (every engine's series labelled ``engine``, the counters also summed
without the label, and the front end's own), ``GET /v1/engines`` (each engine's role,
state and load), ``POST /v1/engines/{index}/drain`` (no new requests there; the engine
finishes what it has and exits) and ``GET /v1/route/decisions`` (the last placements and
what they saw). Everything else goes to a ready engine unchanged.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import re
import time

import httpx2 as httpx
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jserve.routing import ReplicaView, RouteRequest, choose
from jserve.routing.disagg import Placement, TransferCost, place
from jserve.routing.load import ReplicaLoad
from jserve.routing.prefix_memory import PrefixMemory
from jserve.routing.sent import SentLedger
from jserve.serving.auth import bearer_matches
from jserve.serving.engines import DEAD_AFTER_S, DRAINING, POLL_S, READY, Engine
from jserve.serving.route_prompt import route_prompt

log = logging.getLogger(__name__)
RETRIES = 2
ENGINE_HEADER = "x-jserve-engine"
RESPONSES = "/v1/responses"
OWNERS_KEPT = 65536  # response ids remembered with their engine (oldest forgotten first)
_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[^"]+)"')
_GONE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
         httpx.ConnectTimeout, httpx.PoolTimeout)
# What a prefill-only request drops from the body (it returns one token, not streamed).
_PREFILL_DROPS = ("max_completion_tokens", "stream_options", "best_of", "logprobs",
                  "top_logprobs", "echo", "prompt_logprobs", "min_tokens", "n")


@dataclasses.dataclass(frozen=True)
class FrontConfig:
    router: str = "deadline"
    disaggregation: str = "auto"     # jserve.routing.disagg.MODES
    auth_token: str | None = None    # also the engines' (forwarded as the client sent it)
    page_size: int = 16
    request_timeout_s: float = 3600.0


class Front:
    def __init__(self, engines: list[Engine], tokenizer, config: FrontConfig = FrontConfig()):
        self.engines, self.tokenizer, self.config = engines, tokenizer, config
        self.memory = PrefixMemory(config.page_size)
        self.sent = SentLedger()
        self._seq = itertools.count()
        self.decisions: collections.deque = collections.deque(maxlen=256)
        self.owners: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s,
                                                              connect=5.0),
                                        limits=httpx.Limits(max_connections=None,
                                                            max_keepalive_connections=64))
        self.registry = r = CollectorRegistry()
        self.placements = Counter("jserve_front_placements", "Requests placed, by how",
                                  ["placement"], registry=r)
        self.retries = Counter("jserve_front_retries", "Requests sent again to another "
                               "engine after theirs failed before answering", registry=r)
        self.failed = Counter("jserve_front_failed", "Requests ended with an error by the "
                              "front end (no engine could answer, or one died mid-stream)",
                              ["reason"], registry=r)
        self._poller: asyncio.Task | None = None
        self.app = Starlette(routes=[
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/v1/engines", self._engines, methods=["GET"]),
            Route("/v1/engines/{index:int}/drain", self._drain, methods=["POST"]),
            Route("/v1/route/decisions", self._decisions, methods=["GET"]),
            Route("/{path:path}", self._forward, methods=["GET", "POST", "DELETE"]),
        ])

    # -- the engines' reports ----------------------------------------------------------------
    async def start(self) -> None:
        self._poller = asyncio.ensure_future(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.client.aclose()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(e) for e in self.engines
                                   if e.state in (READY, DRAINING)))
            await asyncio.sleep(POLL_S)

    async def _poll(self, e: Engine) -> None:
        if e.proc is not None and e.proc.poll() is not None:
            return self._lost(e, f"its process exited with {e.proc.returncode}")
        try:
            r = await self.client.get(e.url + "/v1/route/load", headers=self._auth(), timeout=2)
            r.raise_for_status()
            d = r.json()
            e.load = dataclasses.replace(ReplicaLoad.from_dict(d), replica=e.name)
            e.kv, e.reported_at = d.get("kv_transfer"), time.time()
            e.last_answer = time.monotonic()
        except (httpx.HTTPError, ValueError, KeyError) as err:
            if time.monotonic() - e.last_answer > DEAD_AFTER_S:
                self._lost(e, f"no report for {DEAD_AFTER_S:g} s ({err!r})")

    def _lost(self, e: Engine, why: str) -> None:
        e.out(why)
        self.memory.forget(e.name)
        self.sent.forget(e.name)

    def _auth(self) -> dict:
        t = self.config.auth_token
        return {"authorization": f"Bearer {t}"} if t else {}

    # -- placement ---------------------------------------------------------------------------
    def _views(self, engines: list[Engine], ids: list[int]) -> list[ReplicaView]:
        out = []
        for e in engines:
            load = e.load or ReplicaLoad.unknown(e.name)
            load = self.sent.with_unreported(load, e.reported_at)
            out.append(ReplicaView(load, self.memory.cached_tokens(e.name, ids)))
        return out

    def _transfer(self, decode: list[Engine]) -> TransferCost:
        reports = [e.kv for e in decode if e.kv]
        per_token = max((k["bytes_per_token"] for k in reports), default=0)
        timed = [k["bytes_per_s"] for k in reports if k.get("timed")]
        rate = sum(timed) / len(timed) if timed else (
            max((k["bytes_per_s"] for k in reports), default=0.0))
        return TransferCost(float(per_token), float(rate), page_size=self.config.page_size)

    def placement(self, ids: list[int], slo: float | None, exclude: set[int] = frozenset(),
                  colocated: bool = False) -> tuple[Engine, Engine | None, str]:
        """(decode engine, prefill engine or None, why) for a prompt (``colocated``: no
        prefill engine); LookupError when no engine takes requests."""
        ready = [e for e in self.engines if e.takes_requests and e.index not in exclude]
        decode = [e for e in ready if not e.prefills_only]
        prefill = [e for e in ready if e.prefills_only and not colocated]
        if not decode:
            raise LookupError("no engine takes requests now")
        request = RouteRequest(len(ids), slo, next(self._seq))
        dviews, pviews = self._views(decode, ids), self._views(prefill, ids)
        if not prefill:
            k = choose(self.config.router, request, dviews)
            chosen = Placement(k, None, 0.0, self.config.router)
        else:
            chosen = place(self.config.disaggregation, request, dviews, pviews,
                           self._transfer(decode))
        d = decode[chosen.decode]
        p = prefill[chosen.prefill] if chosen.prefill is not None else None
        # the engine that prefills: what its prefix cache holds of the prompt
        first = (pviews[chosen.prefill] if p is not None else dviews[chosen.decode])
        self._record(d, p, ids, slo, first.cached_tokens, chosen)
        return d, p, chosen.reason

    def _record(self, d: Engine, p: Engine | None, ids, slo, cached: int,
                chosen: Placement) -> None:
        first = p or d
        self.sent.record(first.name, len(ids), cached, slo)
        self.memory.record(first.name, ids)
        if p is not None:
            self.memory.record(d.name, ids)
        self.placements.labels("disaggregated" if p else "colocated").inc()
        self.decisions.append({"prompt_tokens": len(ids), "ttft_slo": slo,
                               "decode": d.index, "prefill": p.index if p else None,
                               "predicted_ttft_s": chosen.predicted_ttft_s,
                               "reason": chosen.reason, "at": time.time()})

    # -- requests ----------------------------------------------------------------------------
    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        path = "/" + request.path_params["path"]
        headers = _forwarded_headers(request)
        if path.startswith(RESPONSES + "/"):  # a stored response: where it was made
            owner = self._owner(path.split("/")[3])
            return await self._send(request.method, path, headers, body, request.url.query,
                                    [owner] if owner else None)
        if path == RESPONSES and request.method == "POST":
            return await self._responses(path, headers, body)
        prompt = route_prompt(self.tokenizer, path, body) if request.method == "POST" else None
        if prompt is None:  # not a generation: any engine that takes requests answers
            return await self._send(request.method, path, headers, body, request.url.query)
        ids, slo = prompt
        return await self._placed(path, headers, json.loads(body), body, ids, slo)

    async def _placed(self, path: str, headers: dict, parsed: dict, body: bytes,
                      ids: list[int], slo: float | None, pinned: Engine | None = None,
                      colocated: bool = False) -> Response:
        """A generation placed on an engine (``pinned``'s if given and it takes requests)
        and relayed, prefilled on a prefill engine first where the placement says; sent
        again to another engine while none has answered."""
        tried: set[int] = set()
        for _ in range(RETRIES + 1):
            try:
                d, p, _ = ((pinned, None, "pinned") if pinned is not None
                           else self.placement(ids, slo, tried, colocated))
            except LookupError as e:
                self.failed.labels("no_engine").inc()
                return _error(503, f"{e}", "unavailable")
            sent = body
            if p is not None and await self._prefill(p, path, headers, parsed):
                sent = json.dumps(dict(parsed, kv_transfer_params={
                    "do_remote_prefill": True, "remote_url": p.url})).encode()
            try:
                return await self._relay(d, "POST", path, headers, sent,
                                         stream=parsed.get("stream") is True)
            except _GONE as err:
                tried.add(d.index)
                pinned = None
                log.warning("%s failed before answering (%r); sending the request again",
                            d.name, err)
                self.retries.inc()
        self.failed.labels("retries").inc()
        return _error(503, "no engine could take the request", "unavailable")

    async def _responses(self, path: str, headers: dict, body: bytes) -> Response:
        """A Responses API request: on the engine that holds its ``previous_response_id``
        (stored responses stay where they were made), else placed colocated (a Responses
        body carries no KV transfer here); the id of what it answers is remembered."""
        try:
            parsed = json.loads(body)
            given = parsed.get("input")
            ids = self.tokenizer.encode(given if isinstance(given, str) else json.dumps(given))
        except (ValueError, AttributeError, TypeError):  # the engine answers it with a 400
            return await self._send("POST", path, headers, body)
        prev = parsed.get("previous_response_id")
        pinned = self._owner(prev) if isinstance(prev, str) else None
        return await self._placed(path, headers, parsed, body, ids, None, pinned,
                                  colocated=True)

    def _owner(self, response_id: str) -> Engine | None:
        i = self.owners.get(response_id)
        e = self.engines[i] if i is not None else None
        return e if e is not None and e.takes_requests else None

    def _remember(self, e: Engine, chunk: bytes) -> None:
        """Notes which engine made the response whose id ``chunk`` (a body, or a stream's
        first bytes) gives."""
        m = _RESPONSE_ID.search(chunk)
        if m is not None:
            self.owners[m.group(1).decode()] = e.index
            while len(self.owners) > OWNERS_KEPT:
                self.owners.popitem(last=False)

    async def _prefill(self, p: Engine, path: str, headers: dict, body: dict) -> bool:
        """Runs the prompt on prefill engine ``p`` (one token, its pages left cached);
        whether it did (False: the decode engine computes it all)."""
        b = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
        b.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        try:
            r = await self.client.post(p.url + path, headers=headers, content=json.dumps(b))
        except _GONE as err:
            log.warning("prefill on %s failed (%r); the decode engine computes the prompt",
                        p.name, err)
            self.placements.labels("prefill_failed").inc()
            return False
        if r.status_code != 200:
            self.placements.labels("prefill_refused").inc()
            log.warning("prefill on %s answered %d; the decode engine computes the prompt",
                        p.name, r.status_code)
            return False
        return True

    async def _send(self, method: str, path: str, headers: dict, body: bytes,
                    query: str = "", engines: list[Engine] | None = None) -> Response:
        """A request that is not a generation, to the first ready engine (of ``engines``)
        that answers."""
        ready = [e for e in self.engines if e.takes_requests and not e.prefills_only]
        for e in engines or ready:
            try:
                r = await self.client.request(method, e.url + path + (f"?{query}" if query
                                                                      else ""),
                                              headers=headers, content=body)
            except _GONE:
                continue
            return Response(r.content, status_code=r.status_code,
                            headers=_returned_headers(r, e))
        return _error(503, "no engine takes requests now", "unavailable")

    async def _relay(self, e: Engine, method: str, path: str, headers: dict, body: bytes,
                     stream: bool) -> Response:
        """``e``'s response: whole when not streamed; else relayed as it comes, ended with
        an error event if ``e`` fails mid-stream. Raises ``_GONE`` only before anything
        reached the client."""
        if not stream:
            r = await self.client.request(method, e.url + path, headers=headers, content=body)
            if path == RESPONSES:
                self._remember(e, r.content)
            return Response(r.content, status_code=r.status_code,
                            headers=_returned_headers(r, e))
        req = self.client.build_request(method, e.url + path, headers=headers, content=body)
        r = await self.client.send(req, stream=True)
        chunks = r.aiter_raw()  # one iterator: a response streams once
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except _GONE:
            await r.aclose()
            raise
        if path == RESPONSES:
            self._remember(e, first)

        async def rest():
            try:
                if first:
                    yield first
                async for chunk in chunks:
                    yield chunk
            except _GONE + (httpx.ReadTimeout,) as err:
                self.failed.labels("engine_died").inc()
                yield ("data: " + json.dumps({"error": {
                    "message": f"{e.name} failed mid-response: {err!r}", "type": "unavailable",
                    "code": 503}}) + "\n\ndata: [DONE]\n\n").encode()
            finally:
                await r.aclose()
        return StreamingResponse(rest(), status_code=r.status_code,
                                 headers=_returned_headers(r, e))

    # -- its own endpoints -------------------------------------------------------------------
    def _denied(self, request: Request) -> Response | None:
        t = self.config.auth_token
        if t and not bearer_matches(request.headers.get("authorization"), t):
            return _error(401, "missing or wrong bearer token", "unauthenticated")
        return None

    async def _health(self, request: Request) -> Response:
        if any(e.takes_requests and not e.prefills_only for e in self.engines):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "no engine takes requests"}, status_code=503)

    async def _engines(self, request: Request) -> Response:
        return self._denied(request) or JSONResponse(
            [e.describe() for e in self.engines])

    async def _decisions(self, request: Request) -> Response:
        return self._denied(request) or JSONResponse(list(self.decisions))

    async def _drain(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        i = request.path_params["index"]
        if not 0 <= i < len(self.engines):
            return _error(404, f"no engine {i} (there are {len(self.engines)})", "not_found")
        e = self.engines[i]
        if e.state == READY:
            e.state = DRAINING  # no new requests; it finishes what it has, then exits
            if e.proc is not None:
                e.proc.terminate()
        return JSONResponse(e.describe())

    async def _metrics(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        texts = await asyncio.gather(*(self._scrape(e) for e in self.engines
                                       if e.state in (READY, DRAINING)))
        merged = merge_metrics([(e.name, t) for e, t in texts if t is not None])
        return Response(merged + generate_latest(self.registry).decode(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _scrape(self, e: Engine) -> tuple[Engine, str | None]:
        try:
            r = await self.client.get(e.url + "/metrics", headers=self._auth(), timeout=5)
            return e, r.text if r.status_code == 200 else None
        except httpx.HTTPError:
            return e, None


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"}


def _forwarded_headers(request: Request) -> dict:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP}


def _returned_headers(r: httpx.Response, e: Engine) -> dict:
    h = {k: v for k, v in r.headers.items() if k.lower() not in _HOP}
    h[ENGINE_HEADER] = e.name
    return h


def merge_metrics(scrapes: list[tuple[str, str]]) -> str:
    """The engines' Prometheus texts as one: every sample labelled ``engine``, and each
    counter's samples (histograms' buckets, counts and sums too) also summed over the
    engines without the label. Gauges are not summed (a fraction such as the KV usage has
    no sum), nor the ``_created`` timestamps."""
    lines: list[str] = []
    sums: dict[str, dict[tuple, float]] = collections.defaultdict(dict)
    meta: dict[str, tuple[str, str]] = {}
    per: dict[str, list[str]] = collections.defaultdict(list)
    for engine, text in scrapes:
        for fam in text_string_to_metric_families(text):
            meta.setdefault(fam.name, (fam.type, fam.documentation))
            for s in fam.samples:
                labels = dict(s.labels)
                per[fam.name].append(_sample(s.name, dict(labels, engine=engine), s.value))
                if fam.type in ("counter", "histogram") and not s.name.endswith("_created"):
                    key = (s.name, tuple(sorted(labels.items())))
                    sums[fam.name][key] = sums[fam.name].get(key, 0.0) + s.value
    for name, (kind, doc) in meta.items():
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind if kind != 'unknown' else 'untyped'}")
        lines.extend(per[name])
        lines.extend(_sample(n, dict(labels), v) for (n, labels), v in sums[name].items())
    return "\n".join(lines) + "\n"


def _sample(name: str, labels: dict, value: float) -> str:
    if not labels:
        return f"{name} {value!r}"
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value!r}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

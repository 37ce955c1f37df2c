"""Prefill/decode disaggregation at the edge: jserve's KV connector (docs/scale_out.md).

An engine started with ``--kv-transfer-config`` in vLLM's JSON shape,
``{"kv_connector": "JServeConnector", "kv_role": ROLE, "kv_connector_extra_config":
{"peers": [URL, ...], "timeout_s": S}}``, takes part in disaggregation:

- a **producer** (``kv_producer`` or ``kv_both``) answers ``POST /v1/kv/export``
  ``{"token_ids": [...], "lora": ADAPTER or null}`` with the KV pages its prefix cache
  holds of that prompt (its leading full pages, the last token's excluded), in
  ``jserve.engine.device.kv_transfer``'s wire format (``application/octet-stream``). The prefill
  itself is an ordinary request (the router sends it with ``max_tokens: 1``),
  whose pages stay cached when it finishes.
- a **consumer** (``kv_consumer`` or ``kv_both``) takes vLLM's request field
  ``kv_transfer_params`` ``{"do_remote_prefill": true, "remote_url": URL}``. Before the
  request is queued, it pulls the prompt's pages from ``URL`` (one of its ``peers``: an
  engine never fetches from an address a client names) and writes them into its own prefix
  cache, so the request computes only what did not arrive. A pull that fails (the peer
  died, timed out, answered an error or sent pages of another format) is counted by its
  reason and the request is computed here in full; one that brings fewer pages than the
  prompt has (the peer had evicted the rest: ``evicted``; this pool had no room for them:
  ``no_room``) keeps the leading pages that came and computes the rest. A page is written
  whole and registered, or not at all.

The pulls teach a ``CopyRate`` the link's bandwidth, reported with the routing load so
the router prices a transfer (``/v1/route/load``'s ``kv_transfer``).
"""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from prometheus_client import Counter
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jserve import fields
from jserve.copy_rate import CopyRate
from jserve.kv_wire import pages_in
from jserve.serving.auth import bearer_matches
from jserve.serving.engine_api import INVALID
from jserve.serving.gateway import UNAUTHENTICATED, Gateway, Rejected
from jserve.serving.http_protocol import BadField, ClientGone, JSONResponse, read_body, rejection
from jserve.serving.kv_params import KVTransferConfig, TransferParams

log = logging.getLogger(__name__)

MAX_EXPORT_BODY = 16 << 20          # a prompt's ids as JSON (a 1M-token prompt is ~8 MB)
DEFAULT_BYTES_PER_S = 1e9           # a first guess of the link, until a pull is timed


def _refusal(e: Rejected) -> JSONResponse:
    status, body = rejection(e)
    return JSONResponse(body, status_code=status)


class KVConnector:
    """One engine's side of the transfers: its export route (``routes``) and its pulls."""

    def __init__(self, gateway: Gateway, config: KVTransferConfig, server_config):
        self.gateway, self.config = gateway, config
        self.server_config = server_config
        self.token = server_config.auth_token  # the peers share the API key
        info = gateway.engine.info
        self.why_not = info.kv_transfer
        self.bytes_per_token, self.page_size = info.kv_bytes_per_token, info.page_size
        self.rate = CopyRate(DEFAULT_BYTES_PER_S)
        r = gateway.metrics.registry
        self.pages = Counter("jserve_kv_transfer_pages", "KV pages moved between engines",
                             ["direction"], registry=r)
        self.bytes = Counter("jserve_kv_transfer_bytes", "KV bytes moved between engines "
                             "(the wire form)", ["direction"], registry=r)
        self.seconds = Counter("jserve_kv_transfer_seconds", "Seconds of KV pulls (request "
                               "sent to pages in this engine's cache)", registry=r)
        self.failures = Counter("jserve_kv_transfer_failures", "KV pulls that failed or "
                                "came short, by why (what did not come is computed here)",
                                ["reason"], registry=r)
        self.routes = ([Route("/v1/kv/export", self._export, methods=["POST"])]
                       if config.exports else [])
        self._client: aiohttp.ClientSession | None = None

    def check(self, params: TransferParams) -> None:
        """``BadField`` for params this engine cannot honour (before anything is queued)."""
        if self.why_not is not None:
            raise BadField("kv_transfer_params", f"this engine moves no KV pages: "
                                                 f"{self.why_not}")
        if params.do_remote_decode and not self.config.exports:
            raise BadField("kv_transfer_params.do_remote_decode",
                           f"this engine's kv_role is {self.config.role}: it exports no pages")
        if params.do_remote_prefill:
            if not self.config.imports:
                raise BadField("kv_transfer_params.do_remote_prefill",
                               f"this engine's kv_role is {self.config.role}: it pulls no pages")
            if params.remote_url.rstrip("/") not in self.config.peers:
                raise BadField("kv_transfer_params.remote_url",
                               f"{params.remote_url!r} is not one of this engine's peers "
                               "(kv_connector_extra_config.peers)")

    def report(self) -> dict:
        """What a router needs to price a transfer to this engine."""
        return {"bytes_per_token": self.bytes_per_token, "bytes_per_s": self.rate.bytes_per_s,
                "timed": self.rate.samples}

    async def pull(self, params: TransferParams, token_ids: list[int],
                   adapter: str | None) -> int:
        """Pulls the prompt's pages from ``params.remote_url`` into this engine's prefix
        cache; the pages new here (0 after a failure, counted by its reason). Never raises:
        the request runs either way."""
        t0 = time.perf_counter()
        try:
            wire = await asyncio.wait_for(self._fetch(params.remote_url, token_ids, adapter),
                                          self.config.timeout_s)
            seconds = time.perf_counter() - t0
            new, held = await asyncio.wait_for(
                self.gateway.engine.import_kv(token_ids, wire, adapter), self.config.timeout_s)
        except asyncio.TimeoutError:
            return self._failed("timeout", params.remote_url)
        except aiohttp.ClientResponseError as e:
            return self._failed("refused", params.remote_url, e.status)
        except aiohttp.ClientError as e:  # refused connection, a body cut short
            return self._failed("unreachable", params.remote_url, e)
        except ValueError as e:  # not this engine's pages (PageFormatError), or no room
            return self._failed("format", params.remote_url, e)
        self.rate.observe(len(wire), seconds)
        self.pages.labels("imported").inc(new)
        sent, whole = pages_in(wire), (len(token_ids) - 1) // self.page_size
        if held < sent:
            self._short("no_room", params.remote_url, f"{held} of {sent} pages sent kept")
        elif sent < whole:
            self._short("evicted", params.remote_url, f"{sent} of {whole} pages sent")
        self.bytes.labels("imported").inc(len(wire))
        self.seconds.inc(time.perf_counter() - t0)
        return new

    def _short(self, reason: str, url: str, detail: str) -> None:
        log.info("KV pull from %s came short (%s: %s); computing the rest here", url, reason,
                 detail)
        self.failures.labels(reason).inc()

    def _failed(self, reason: str, url: str, detail: object = "") -> int:
        log.warning("KV pull from %s failed (%s%s); computing the prompt here", url, reason,
                    f": {detail}" if detail != "" else "")
        self.failures.labels(reason).inc()
        return 0

    async def _fetch(self, url: str, token_ids: list[int], adapter: str | None) -> bytes:
        # aiohttp, not httpx2: its pulls take 0.6-0.9x the time here (docs/scale_out.md)
        if self._client is None:
            self._client = aiohttp.ClientSession()
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        async with self._client.post(url.rstrip("/") + "/v1/kv/export", headers=headers,
                                     json={"token_ids": token_ids, "lora": adapter},
                                     raise_for_status=True) as r:
            return await r.read()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def _export(self, request: Request) -> Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        try:
            raw = await read_body(request.scope, request.receive, MAX_EXPORT_BODY)
            ids, adapter = self._export_body(raw)
            wire = await self.gateway.engine.export_kv(ids, adapter)
        except ClientGone:
            return Response(status_code=499)
        except Rejected as e:
            return _refusal(e)
        except ValueError as e:  # a bad body, or an engine that moves no pages
            return _refusal(Rejected(INVALID, str(e)))
        self.pages.labels("exported").inc(pages_in(wire))
        self.bytes.labels("exported").inc(len(wire))
        return Response(wire, media_type="application/octet-stream")

    def _denied(self, request: Request) -> Response | None:
        if self.token is not None and not bearer_matches(request.headers.get("authorization"),
                                                         *self.server_config.tokens):
            return _refusal(Rejected(UNAUTHENTICATED, "missing or wrong bearer token"))
        if self.why_not is not None:
            return _refusal(Rejected(INVALID, f"this engine moves no KV pages: "
                                              f"{self.why_not}"))
        return None

    def _export_body(self, raw: bytes) -> tuple[list[int], str | None]:
        body = fields.loads(raw, "the request body")
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        ids, adapter = body.get("token_ids"), body.get("lora")
        if not (isinstance(ids, list) and ids and all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise ValueError("token_ids must be a non-empty list of token ids")
        if adapter is not None and not isinstance(adapter, str):
            raise ValueError("lora must be an adapter's name or null")
        return ids, adapter

"""What routers read from a replica, under the names they read it by.

- Prometheus gauges and counters under vLLM's names (``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` and its older name
  ``vllm:gpu_cache_usage_perc``, ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``,
  ``vllm:num_preemptions``, ``vllm:prompt_tokens``, ``vllm:generation_tokens``,
  ``vllm:request_success{finished_reason}``) and vLLM's latency histograms
  (``_VLLM_HISTOGRAMS``: TTFT, inter-token latency, e2e, queue, prefill, decode, ...), each
  labelled ``model_name`` as vLLM does: what the Gateway API Inference Extension's endpoint
  picker (llm-d) and vLLM's Grafana dashboard scrape. They are read at scrape time from
  jserve's own metrics (a histogram with jserve's buckets), so the two sets never disagree.
  With LoRA, ``vllm:lora_requests_info`` (unlabelled by model, as vLLM's): the adapters of
  the running and waiting requests, which the endpoint picker's LoRA affinity reads.
- SGLang's load endpoints, which ``smg`` (SGLang's model gateway) polls: ``GET /get_load``
  (and ``/v1/loads``): one entry per data-parallel rank (jserve has one) with ``num_reqs``
  (waiting + running), ``num_waiting_reqs`` and ``num_tokens`` (KV tokens in use);
  ``/model_info`` and ``/server_info`` (and their older ``/get_`` names), which smg reads when
  it registers a worker; ``/health_generate``: 200 only when the engine
  thread answers between steps (``/health`` only says the server is up and not draining).
- jserve's own: ``GET /v1/route/load``: this replica's ``jserve.routing.ReplicaLoad``;
  ``POST /v1/route/wait`` with ``prompt`` (text or token ids) or ``prompt_tokens`` (a length)
  and optionally ``ttft_slo``: what a request of that prompt would wait here (predicted TTFT
  by the scheduler's prefill-time model, less the prefix this replica has cached) with the
  cached tokens and the report.

The load endpoints sit behind the same token as ``/metrics``. Everything here is read through
the ``EngineClient`` (``engine_api``): its ``info``, ``ping``, ``load_report`` and
``predicted_wait``, and the server's own metrics.
"""
from __future__ import annotations

import asyncio
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jserve import fields
from jserve.serving.auth import bearer_matches
from jserve.serving.engine_api import INVALID
from jserve.serving.gateway import UNAUTHENTICATED, Gateway, Rejected
from jserve.serving.http_protocol import (
    ClientGone,
    JSONResponse,
    error_body,
    read_body,
    rejection,
)
from jserve.serving.metrics import ServerMetrics


def _value(metric) -> float:
    """The one sample of an unlabelled gauge or counter (``_total`` for a counter)."""
    return next(s.value for s in metric.collect()[0].samples if not s.name.endswith("_created"))


def _histogram(metric) -> tuple[list[tuple[str, float]], float]:
    """An unlabelled histogram's cumulative buckets (``le``, count) and sum."""
    samples = metric.collect()[0].samples
    buckets = [(s.labels["le"], s.value) for s in samples if s.name.endswith("_bucket")]
    return buckets, next(s.value for s in samples if s.name.endswith("_sum"))


# vLLM's latency histograms (``vllm/v1/metrics/loggers.py``), each from the jserve histogram
# of the same measurement: same observations, jserve's buckets.
_VLLM_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "Time to first token (s)", "ttft"),
    ("vllm:inter_token_latency_seconds", "Gap between consecutive tokens (s)", "tpot"),
    ("vllm:time_per_output_token_seconds", "Gap between consecutive tokens (s; vLLM's older "
     "name of vllm:inter_token_latency_seconds)", "tpot"),
    ("vllm:request_time_per_output_token_seconds", "A request's mean time per output token (s)",
     "request_tpot"),
    ("vllm:e2e_request_latency_seconds", "End-to-end request latency (s)", "e2e"),
    ("vllm:request_queue_time_seconds", "Time in the WAITING phase (s)", "queue_time"),
    ("vllm:request_prefill_time_seconds", "Time in the PREFILL phase (s)", "prefill_time"),
    ("vllm:request_decode_time_seconds", "Time in the DECODE phase (s)", "decode_time"),
    ("vllm:request_inference_time_seconds", "Time in the RUNNING phase (s)", "inference_time"),
    ("vllm:request_prompt_tokens", "Prompt tokens per finished request",
     "request_prompt_tokens"),
    ("vllm:request_generation_tokens", "Generated tokens per finished request",
     "request_generation_tokens"),
)
# vllm:request_success_total's finished_reason from jserve_requests_total's outcomes.
_FINISHED_REASONS = (("stop", ("stop",)), ("length", ("length",)),
                     ("abort", ("cancelled", "deadline_exceeded")), ("error", ("internal",)))


class VllmNames:
    """A collector of jserve's engine metrics under vLLM's names (read at each scrape)."""

    def __init__(self, metrics: ServerMetrics, model_name: str):
        self.m, self.model = metrics, model_name

    def collect(self):
        m, label = self.m, [self.model]
        used, free = _value(m.pages_used), _value(m.pages_free)
        usage = used / (used + free) if used + free else 0.0
        gauges = [("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                   _value(m.waiting)),
                  ("vllm:num_requests_running", "Requests holding KV (prefill or decode)",
                   _value(m.running)),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full", usage),
                  ("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = full (vLLM's older name)",
                   usage)]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            yield g
        counters = [("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                     m.prefix_queried),
                    ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                     m.prefix_hits),
                    ("vllm:num_preemptions", "Requests preempted", m.preemptions),
                    ("vllm:prompt_tokens", "Prompt tokens admitted", m.prompt_tokens),
                    ("vllm:generation_tokens", "Tokens generated", m.generation_tokens)]
        for name, doc, metric in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, _value(metric))
            yield c
        if m.kv_tier_stats is not None:
            yield from _host_tier(m.kv_tier_stats(), label)
        if m.lora is not None:
            yield _lora_info(m.lora, m.max_loras)
        outcomes = {s.labels["outcome"]: s.value for s in m.requests.collect()[0].samples
                    if s.name.endswith("_total")}
        c = CounterMetricFamily("vllm:request_success", "Finished requests by finished_reason",
                                labels=["model_name", "finished_reason"])
        for reason, of in _FINISHED_REASONS:
            c.add_metric([self.model, reason], sum(outcomes.get(o, 0.0) for o in of))
        yield c
        for name, doc, attr in _VLLM_HISTOGRAMS:
            buckets, total = _histogram(getattr(m, attr))
            h = HistogramMetricFamily(name, doc, labels=["model_name"])
            h.add_metric(label, buckets, total)
            yield h


def _host_tier(s: dict, label: list[str]):
    """The host tier under vLLM's names: its hits as an external prefix cache's (a
    connector's), its pool's use as the v0 engine's CPU swap space's."""
    for name, doc, value in (
            ("vllm:external_prefix_cache_queries", "Prompt tokens looked up in the host tier",
             s["queried_tokens"]),
            ("vllm:external_prefix_cache_hits", "Prompt tokens found in the host tier",
             s["host_hit_tokens"])):
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric(label, value)
        yield c
    g = GaugeMetricFamily("vllm:cpu_cache_usage_perc", "Host-tier KV usage, 1 = full",
                          labels=["model_name"])
    g.add_metric(label, s["host_pages_used"] / max(s["host_pages_total"], 1))
    yield g


def _lora_info(s, max_loras: int) -> GaugeMetricFamily:
    """vLLM's ``vllm:lora_requests_info``: one series, labelled with the adapters of the
    running and of the waiting requests (comma-joined) and ``max_lora``, its value the time
    (Unix seconds) the state was read, so a reader takes the latest series."""
    g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                          labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    g.add_metric([str(max_loras), ",".join(s.waiting), ",".join(s.running)], time.time())
    return g


def export_vllm_names(metrics: ServerMetrics, model_name: str) -> None:
    metrics.registry.register(VllmNames(metrics, model_name))


class RouterEndpoints:
    """The HTTP routes above, for the OpenAI server's app (``routes``)."""

    def __init__(self, gateway: Gateway, config, kv=None):
        self.gateway, self.config = gateway, config
        self.kv = kv  # the engine's KV connector (``kv_connector``), if it has one
        self.routes = [
            Route("/get_load", self._get_load, methods=["GET"]),
            Route("/v1/loads", self._get_load, methods=["GET"]),
            Route("/get_model_info", self._model_info, methods=["GET"]),
            Route("/model_info", self._model_info, methods=["GET"]),
            Route("/get_server_info", self._server_info, methods=["GET"]),
            Route("/server_info", self._server_info, methods=["GET"]),
            Route("/health_generate", self._health_generate, methods=["GET"]),
            Route("/v1/route/load", self._route_load, methods=["GET"]),
            Route("/v1/route/wait", self._route_wait, methods=["POST"]),
        ]

    def _denied(self, request: Request) -> Response | None:
        token = self.config.metrics_token
        if token is None or bearer_matches(request.headers.get("authorization"), token):
            return None
        return JSONResponse(error_body(UNAUTHENTICATED, "this endpoint needs the bearer token "
                                       "(or the server's --metrics-open)")[1], status_code=401)

    async def _get_load(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        m = self.gateway.metrics
        waiting, running = int(_value(m.waiting)), int(_value(m.running))
        page = self.gateway.engine.info.page_size
        return JSONResponse([{"dp_rank": 0, "num_reqs": waiting + running,
                              "num_waiting_reqs": waiting,
                              "num_tokens": int(_value(m.pages_used)) * page}])

    async def _model_info(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        info = self.gateway.engine.info
        return JSONResponse({"model_path": self.config.model_name,
                             "tokenizer_path": self.config.model_name,
                             "is_generation": True, "max_model_len": info.max_model_len})

    async def _server_info(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        info = self.gateway.engine.info
        # (read between steps, the KV pool checked whole: pages held, free, in all)
        stats = await self.gateway.engine.stats()
        kv = self.config.kv_transfer
        return JSONResponse({"model_path": self.config.model_name, "dp_size": 1,
                             "scheduler": info.scheduler, "page_size": info.page_size,
                             "max_model_len": info.max_model_len,
                             "max_num_seqs": info.max_num_seqs,
                             "prefix_caching": info.prefix_caching,
                             "kv_role": kv.role if kv is not None else None,
                             "kv_transfer_unsupported": info.kv_transfer,
                             "kv_pages": {k: stats[k] for k in ("pages_used", "pages_free",
                                                                "pages_total")}})

    async def _health_generate(self, request: Request) -> Response:
        gw = self.gateway
        if not gw.healthy:
            state = "draining" if gw.draining or gw.leaving else "engine stopped"
            return JSONResponse({"status": state}, status_code=503)
        try:
            await asyncio.wait_for(gw.engine.ping(), 10.0)
        except (asyncio.TimeoutError, RuntimeError):
            return JSONResponse({"status": "engine not answering"}, status_code=503)
        return JSONResponse({"status": "ok"})

    # -- jserve's routing reports ----------------------------------------------------------
    async def _route_load(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        gw = self.gateway
        load = await gw.engine.load_report(self.config.model_name, healthy=gw.healthy)
        report = load.to_dict()
        if self.kv is not None:  # what pricing a KV transfer to this engine needs
            report["kv_transfer"] = self.kv.report()
        return JSONResponse(report)

    async def _route_wait(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            raw = await read_body(request.scope, request.receive, self.config.max_request_bytes)
            ids, n, slo = await self.gateway.off_loop(self._parse_wait, raw)
        except Rejected as e:  # a body over the limit: 413
            status, body = rejection(e)
            return JSONResponse(body, status_code=status)
        except (ValueError, TypeError) as e:
            return JSONResponse(error_body(INVALID, str(e))[1], status_code=400)
        except ClientGone:
            return Response(status_code=499)
        gw = self.gateway
        wait = await gw.engine.predicted_wait(self.config.model_name, ids, n, slo,
                                              healthy=gw.healthy)
        return JSONResponse({"prompt_tokens": n, "cached_tokens": wait.cached_tokens,
                             "predicted_ttft_s": wait.predicted_ttft_s,
                             "load": wait.load.to_dict()})

    def _parse_wait(self, raw: bytes) -> tuple[list[int] | None, int, float | None]:
        """(token ids or None, prompt length, ttft_slo) of a /v1/route/wait body."""
        body = fields.loads(raw, "the request body")
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        slo = fields.optional_number("ttft_slo", body.get("ttft_slo"))
        if "prompt" in body:
            prompt = body["prompt"]
            if not (isinstance(prompt, str) or isinstance(prompt, list) and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
                raise ValueError("prompt must be a string or a list of token ids")
            ids = self.gateway.engine.tokenize(prompt)
            return ids, len(ids), slo
        if "prompt_tokens" not in body:
            raise ValueError("give 'prompt' (text or token ids) or 'prompt_tokens' (>= 1)")
        return None, fields.number("prompt_tokens", body["prompt_tokens"]), slo

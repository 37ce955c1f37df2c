"""Prometheus metrics of one server (own registry, so several servers can live in a process).

Latency histograms are observed on the engine thread as tokens come out; gauges are set after
every engine iteration. prometheus-client is thread-safe.
"""
from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app
from prometheus_client.core import CounterMetricFamily

from jserve.serving.auth import bearer_matches
from jserve.serving.edge import EdgeLimits, EdgeServer

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0)
# Request outcomes (label values of jserve_requests_total).
OUTCOMES = ("stop", "length", "cancelled", "deadline_exceeded", "invalid_argument",
            "resource_exhausted", "unavailable", "internal", "already_exists",
            "unauthenticated", "not_found")


class ServerMetrics:
    def __init__(self, rate_window_s: float = 10.0):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("jserve_time_to_first_token_seconds",
                              "Arrival at the server to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jserve_time_per_output_token_seconds",
                              "Gap between consecutive generated tokens of a request",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("jserve_e2e_request_latency_seconds",
                             "Arrival to the last token of finished requests",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("jserve_num_requests_waiting",
                             "Requests queued for admission (incl. preempted)", registry=r)
        self.running = Gauge("jserve_num_requests_running",
                             "Requests holding KV pages (prefilling or decoding)", registry=r)
        self.pages_used = Gauge("jserve_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.pages_free = Gauge("jserve_kv_blocks_free", "KV cache blocks free", registry=r)
        self.preemptions = Counter("jserve_preemptions", "Requests preempted under KV pressure",
                                   registry=r)
        self.prompt_tokens = Counter("jserve_prompt_tokens", "Prompt tokens admitted",
                                     registry=r)
        self.generation_tokens = Counter("jserve_generation_tokens", "Tokens generated",
                                         registry=r)
        self.tokens_per_second = Gauge(
            "jserve_generation_tokens_per_second",
            f"Tokens generated per second over the last {rate_window_s:g} s", registry=r)
        self.requests = Counter("jserve_requests", "Requests by outcome", ["outcome"],
                                registry=r)
        self.grpc_received = Counter(
            "jserve_grpc_requests_received",
            "gRPC calls handed to a handler (every Generate call, and a call of any method "
            "refused for its bearer token); each ends in one jserve_requests_total outcome",
            registry=r)
        self.prefix_queried = Counter("jserve_prefix_cache_queried_tokens",
                                      "Prompt tokens looked up in the prefix cache at admission",
                                      registry=r)
        self.prefix_hits = Counter("jserve_prefix_cache_hit_tokens",
                                   "Prompt tokens found in the prefix cache (not prefilled)",
                                   registry=r)
        self.cached_pages = Gauge("jserve_prefix_cache_blocks",
                                   "KV pages registered in the prefix cache (in use or idle)",
                                   registry=r)
        self._prefix_seen = (0, 0)
        for o in OUTCOMES:
            self.requests.labels(o)
        self._window = rate_window_s
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._recent_sum = 0
        self._preemptions_seen = 0

    def outcome(self, name: str) -> None:
        self.requests.labels(name).inc()

    def engine_state(self, *, waiting: int, running: int, pages_used: int, pages_free: int,
                     preemptions: int, new_tokens: int, prefix_queried: int = 0,
                     prefix_hits: int = 0, cached_pages: int = 0) -> None:
        """After each engine iteration (engine thread); counts are the engine's totals."""
        queried, hits = self._prefix_seen
        self.prefix_queried.inc(max(prefix_queried - queried, 0))
        self.prefix_hits.inc(max(prefix_hits - hits, 0))
        self._prefix_seen = (prefix_queried, prefix_hits)
        self.cached_pages.set(cached_pages)
        self.waiting.set(waiting)
        self.running.set(running)
        self.pages_used.set(pages_used)
        self.pages_free.set(pages_free)
        if preemptions > self._preemptions_seen:
            self.preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        now = time.monotonic()
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
            self._recent.append((now, new_tokens))
            self._recent_sum += new_tokens
        while self._recent and self._recent[0][0] < now - self._window:
            self._recent_sum -= self._recent.popleft()[1]
        self.tokens_per_second.set(self._recent_sum / self._window)

    def watch_speculation(self, speculator) -> None:
        """Speculative decoding's counters, read at each scrape (``Speculator.stats``)."""
        self.registry.register(_SpeculationCollector(speculator))

    def watch_grammars(self, compiler) -> None:
        """Structured output's grammar cache, read at each scrape: compilations and hits."""
        self.registry.register(_GrammarCollector(compiler))

    async def serve_http(self, port: int, host: str = "0.0.0.0", token: str | None = None,
                         limits=None):
        """Serves /metrics on the running event loop behind the bounded edge of
        ``jserve.serving.edge`` (``limits``: an ``EdgeLimits``), so an open connection costs
        no thread; returns the started ``EdgeServer`` (``.port``, ``await .stop(t)``). With
        ``token``, a scrape without ``Authorization: Bearer <token>`` gets 401."""
        metrics = make_asgi_app(self.registry)

        async def app(scope, receive, send) -> None:
            if token is None or bearer_matches(dict(scope["headers"]).get(b"authorization"),
                                               token):
                return await metrics(scope, receive, send)
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"text/plain"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": b"missing or wrong bearer token\n"})

        server = EdgeServer(app, limits or EdgeLimits())
        await server.start(host, port)
        return server


class _GrammarCollector:
    def __init__(self, compiler):
        self._compiler = compiler

    def collect(self):
        c = self._compiler
        yield CounterMetricFamily("jserve_grammar_compiles", "Structured-output grammars "
                                  "compiled (a distinct constraint compiles once)", c.compiles)
        yield CounterMetricFamily("jserve_grammar_cache_hits", "Structured-output requests "
                                  "whose grammar was already compiled", c.hits)


class _SpeculationCollector:
    def __init__(self, speculator):
        self._speculator = speculator

    def collect(self):
        s = self._speculator.stats()
        yield CounterMetricFamily("jserve_spec_decode_num_draft_tokens", "Draft tokens "
                                  "verified (speculative decoding)", s["draft_tokens"])
        yield CounterMetricFamily("jserve_spec_decode_num_accepted_tokens", "Draft tokens "
                                  "accepted", s["accepted_tokens"])
        yield CounterMetricFamily("jserve_spec_decode_num_drafts", "Speculating decodes "
                                  "verified (mean accepted length: (accepted + drafts) / "
                                  "drafts tokens a step)", s["drafts"])

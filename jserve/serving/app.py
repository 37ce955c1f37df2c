"""The composition root of ``jserve serve``: one process, one engine, its front ends.

``Server`` builds them all on one ``Gateway``: the OpenAI-compatible HTTP API (the server
users call, ``http_server``), the gRPC service beside it (a peer, ``grpc_server``) and the
``/metrics`` endpoint; it starts the engine thread (an ``EngineClient``: ``LiveEngine`` over an
``LLMEngine``, or a ``FakeEngine``) and drains all of them on SIGTERM. ``BackgroundServer``
runs one on a thread of its own (notebooks, tests); ``serve`` until a signal.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
import time

from jserve.serving import engine_api as el
from jserve.serving.edge import EdgeLimits
from jserve.serving.engine_api import EngineClient
from jserve.serving.gateway import Gateway
from jserve.serving.grpc_server import GrpcServer
from jserve.serving.http_server import OpenAIServer
from jserve.serving.kv_params import KVTransferConfig
from jserve.serving.limits import ClientLimits
from jserve.serving.live_engine import LiveEngine
from jserve.serving.metrics import ServerMetrics
from jserve.serving.reasoning import FORMATS as REASONING
from jserve.serving.router_endpoints import export_vllm_names
from jserve.serving.tool_formats import DEFAULT_FORMAT, TOOL_FORMATS

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"            # loopback; "0.0.0.0" opens every endpoint to the network
    port: int | None = 50051                  # gRPC; 0: a free port (``Server.port``); None: off
    metrics_port: int | None = 9400    # None: no separate /metrics endpoint; 0: a free port
    http_port: int | None = None       # OpenAI-compatible HTTP API; None: off; 0: a free port
    max_waiting: int = 1024            # admission queue; one more gets RESOURCE_EXHAUSTED
    max_request_bytes: int = 4 << 20   # bigger messages: RESOURCE_EXHAUSTED / HTTP 413
    # The HTTP ports' edge (jserve/serving/edge.py), each port on its own: seconds from
    # accept (or a new request's first byte) to a whole request head, seconds from a head's
    # end to its body's end (later: 408), the head's size (larger: 431), connections open at
    # once, TLS handshakes included (a request on one more: 503).
    head_timeout: float = 10.0
    body_timeout: float = 30.0
    max_head_bytes: int = 64 << 10
    max_connections: int = 2048
    grace_period: float = 30.0         # seconds in-flight requests get to finish on SIGTERM
    # Seconds between SIGTERM and the drain during which health checks fail while requests
    # are still served: a router polling /health stops sending before anything is refused.
    drain_notice: float = 0.0
    tls_cert: str | None = None        # PEM files; both or neither
    tls_key: str | None = None
    auth_token: str | None = None      # clients send "authorization: Bearer <token>"
    metrics_open: bool = False         # /metrics without the token even with auth_token
    # The names requests may give in ``model``; the first is the one reported (/v1/models,
    # responses, GetModelInfo.model).
    served_model_names: tuple[str, ...] = ("default",)
    limits: ClientLimits = ClientLimits()  # SLO floors, priorities, choices per request
    # The format the model writes tool calls in (vLLM's --tool-call-parser names).
    tool_call_parser: str = DEFAULT_FORMAT
    # How chat replies' reasoning is told from their answer (vLLM's --reasoning-parser names,
    # ``jserve.serving.reasoning``); None: the reply is all content.
    reasoning_parser: str | None = None
    # The model's default sampling fields for requests that leave them unset, max_tokens
    # also a cap (``jserve.sampling.generation_config``: its generation_config.json).
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    # The Responses API's stored responses (previous_response_id, GET /v1/responses/{id}):
    # at most this many bytes of their JSON, least recently used dropped; 0: none kept.
    responses_store_bytes: int = 64 << 20
    # Prefill/decode disaggregation (``--kv-transfer-config``, ``kv_connector``): this
    # engine's role and peers; None: it takes no part (``kv_transfer_params`` refused).
    kv_transfer: KVTransferConfig | None = None

    @property
    def open_to_the_network(self) -> bool:
        """Bound beyond loopback with no bearer token: anyone who can reach it may use it."""
        return self.auth_token is None and self.host not in LOOPBACK

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokens(self) -> tuple[str, ...]:
        """Bearer tokens that may use the server (the priority token is one too)."""
        return tuple(t for t in (self.auth_token, self.limits.priority_token) if t)

    @property
    def metrics_token(self) -> str | None:
        """The token /metrics asks for: the auth token unless ``metrics_open``."""
        return None if self.metrics_open else self.auth_token

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.responses_store_bytes < 0:
            raise ValueError(f"responses_store_bytes must be >= 0, got "
                             f"{self.responses_store_bytes}")
        if not self.head_timeout > 0:
            raise ValueError(f"head_timeout must be > 0, got {self.head_timeout}")
        if not self.body_timeout > 0:
            raise ValueError(f"body_timeout must be > 0, got {self.body_timeout}")
        if self.max_head_bytes < 1024:
            raise ValueError(f"max_head_bytes must be >= 1024, got {self.max_head_bytes}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.grace_period < 0:
            raise ValueError(f"grace_period must be >= 0, got {self.grace_period}")
        if not self.drain_notice >= 0:
            raise ValueError(f"drain_notice must be >= 0, got {self.drain_notice}")
        if self.tool_call_parser not in TOOL_FORMATS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_FORMATS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING)} or None, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser == "openai" and self.reasoning_parser != "openai_gptoss":
            raise ValueError("tool_call_parser openai reads gpt-oss's harmony replies: it "
                             "needs reasoning_parser openai_gptoss (--reasoning-parser)")
        names = self.served_model_names
        if isinstance(names, str) or not names or not all(isinstance(n, str) and n
                                                          for n in names):
            raise ValueError(f"served_model_names must be a tuple of names, got {names!r}")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token is empty")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} is not a file")



class Server:
    """``await start()``, then ``await stop()`` (the drain).

    The engine's front ends through one ``Gateway``: the HTTP API (``http``, an ASGI app,
    on ``config.http_port``), the gRPC service (``config.port``) and ``/metrics``
    (``config.metrics_port``); each port None: not served (Ray's replicas serve ``http``
    through Ray). ``engine`` is an ``EngineClient`` (an ``LLMEngine`` is wrapped in a
    ``LiveEngine``); the server starts it in ``start()`` and owns it from then on.
    """

    def __init__(self, engine: EngineClient, config: ServerConfig = ServerConfig()):
        if not isinstance(engine, EngineClient):  # an LLMEngine
            engine = LiveEngine(engine)
        self.engine = engine
        self.config = config
        engine.max_waiting = config.max_waiting
        self.metrics = ServerMetrics()
        engine.attach_metrics(self.metrics)
        export_vllm_names(self.metrics, config.model_name)
        self.gateway = Gateway(engine, self.metrics, config.limits)
        self.http = OpenAIServer(self.gateway, config)  # (served on a port or, Ray's, not)
        self.grpc = (GrpcServer(self.gateway, self.metrics, config)
                     if config.port is not None else None)
        self.port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_http = None

    @property
    def draining(self) -> bool:
        return self.gateway.draining

    @property
    def calls_in_flight(self) -> int:
        """gRPC Generate handlers running (accepted or not)."""
        return self.grpc.calls_in_flight if self.grpc is not None else 0

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        if self.grpc is not None:
            self.port = self.grpc.bind()
        if cfg.http_port is not None:
            self.http_port = await self.http.start(cfg.host, cfg.http_port)
        self.start_engine()
        if self.grpc is not None:
            await self.grpc.start()
        if cfg.metrics_port is not None:
            self._metrics_http = await self.metrics.serve_http(
                cfg.metrics_port, cfg.host, cfg.metrics_token, EdgeLimits.of(cfg))
            self.metrics_port = self._metrics_http.port
        log.info("serving%s%s", f" the OpenAI API on http://{cfg.host}:{self.http_port}/v1"
                 if self.http_port is not None else "",
                 f" and gRPC on {cfg.host}:{self.port}" if self.port is not None else "")
        if cfg.open_to_the_network:
            log.warning("OPEN SERVER: bound to %s with no --auth-token: anyone who can reach "
                        "this host can generate and read /metrics", cfg.host)

    async def stop(self, grace: float | None = None, *, hurry: asyncio.Event | None = None
                   ) -> None:
        """Drain (after ``drain_notice`` seconds of failing health checks while still serving):
        refuse new requests (UNAVAILABLE / 503), report NOT_SERVING, give in-flight
        requests ``grace`` seconds (the config's by default; ``hurry`` set cuts it short) to
        finish, then end the rest with UNAVAILABLE and stop, within about half a second of
        the grace period's end however busy the engine thread is."""
        grace = self.config.grace_period if grace is None else grace
        if self.config.drain_notice > 0 and not self.gateway.draining:
            self.gateway.leaving = True  # health fails; requests are still accepted
            await self._leave()
            await _first(asyncio.sleep(self.config.drain_notice), hurry)
        self.gateway.draining = True
        await self._leave()
        if self.gateway.in_flight:
            await _first(self.gateway.wait_drained(), hurry, timeout=grace)
        # The engine thread may be inside a long step (or a compile): end the streams from
        # here, ask it to stop, and wait for it only briefly (it is a daemon thread).
        t0 = time.monotonic()
        log.info("grace over: ending %d requests", self.gateway.in_flight)
        self.gateway.end_all(el.UNAVAILABLE, "the server is shutting down")
        loop = asyncio.get_running_loop()
        stopping = loop.run_in_executor(None, self.engine.shutdown, 0.2)
        await asyncio.sleep(0.05)  # lets the handlers send their statuses
        metrics_stop = (asyncio.ensure_future(self._metrics_http.stop(0.2))  # alongside
                        if self._metrics_http is not None else None)
        if self.http_port is not None:
            await self.http.stop(0.2)
        if self.grpc is not None:
            await self.grpc.stop(0.2)
        if metrics_stop is not None:
            await metrics_stop
            self._metrics_http = None
        await stopping
        self.gateway.close()
        log.info("stopped %.2f s after the grace period", time.monotonic() - t0)

    async def _leave(self) -> None:
        if self.grpc is not None:  # (HTTP's /health reads the gateway)
            await self.grpc.leave()

    def start_engine(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Starts the engine thread alone (``start`` does; Ray's replicas serve without
        ports); if it dies, health turns NOT_SERVING."""
        self.engine.start(loop or asyncio.get_running_loop(), on_crash=self._engine_died)

    def _engine_died(self, error: BaseException) -> None:
        """The engine thread is gone (not a failed step: those are handled): report it."""
        log.error("engine thread died (%s); reporting NOT_SERVING", error)
        if self.grpc is not None:  # (HTTP's /health reads ``engine.alive``)
            asyncio.ensure_future(self.grpc.set_serving(False))


async def _first(wait, hurry: asyncio.Event | None, timeout: float | None = None) -> None:
    """Until ``wait`` is done, ``hurry`` is set or ``timeout`` passes."""
    waits = [asyncio.ensure_future(wait)]
    if hurry is not None:
        waits.append(asyncio.ensure_future(hurry.wait()))
    await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()


class BackgroundServer:
    """A ``Server`` on its own event loop in a daemon thread, for embedding (notebooks,
    tests): ``BackgroundServer(engine, config).target`` is ready to dial; ``stop()`` drains."""

    def __init__(self, engine: EngineClient, config: ServerConfig = ServerConfig()):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jserve-grpc",
                                        daemon=True)
        self._thread.start()

        async def create() -> Server:
            server = Server(engine, config)
            await server.start()
            return server
        self.server = self.run(create())
        host = "127.0.0.1" if config.host in ("0.0.0.0", "[::]", "") else config.host
        self.target = f"{host}:{self.server.port}"
        self.http_url = (f"http://{host}:{self.server.http_port}"
                         if self.server.http_port is not None else None)

    def run(self, coro, timeout: float | None = None):
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stats(self) -> dict[str, int]:
        return self.run(self.server.engine.stats())

    def stop(self, grace: float | None = None) -> None:
        if self._loop.is_closed():
            return
        self.run(self.server.stop(grace))
        self.server.engine.shutdown()  # the engine is the caller's again once stopped
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def serve(engine: EngineClient, config: ServerConfig, *, ready=None) -> int:
    """Runs until SIGTERM or SIGINT, then drains (a second signal cuts the grace short).
    ``ready(server)`` is called once the ports are bound."""
    server = Server(engine, config)
    await server.start()
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    if ready is not None:
        ready(server)
    await stop.wait()
    log.info("draining: %d requests in flight, grace %.1f s", server.gateway.in_flight,
             config.grace_period)
    await server.stop(hurry=hurry)
    return 0

"""jserve as a Ray Serve application: ``serve run jserve.serving.ray_app:build_app
replicas=2`` or ``jserve serve --ray --replicas 2``.

Two deployments. ``JServeReplica``: one engine per replica (its own process, and its own
devices where ``num_gpus`` is given), running jserve's OpenAI app in process (the same gateway,
engine loop and handlers as ``jserve serve``; no ports of its own), reporting its
``jserve.routing.ReplicaLoad`` as Ray's routing stats. ``Ingress``: Ray's HTTP proxy hands it
every request; it reads the prompt (token ids through the model's tokenizer) and calls a
replica through a handle whose request router is ``JServeRouter``: ``jserve.routing.choose``
(deadline-aware by default; round_robin, least_load or prefix to compare) over the replicas'
routing stats, with prefix hits guessed from where earlier prompts went
(``jserve.routing.prefix_memory``). A request whose replica dies before its response started
is sent again to another replica; a stopping replica finishes what it accepted (Ray waits up
to ``graceful_shutdown_timeout_s``). Autoscaling (``autoscale=(min, max)``) follows Ray's
ongoing-requests-per-replica target: queue depth.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import signal
import threading
import time
from typing import Any, AsyncIterator

import ray
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from jserve.engine.config import EngineConfig
from jserve.routing import ROUTERS, ReplicaLoad, ReplicaView, RouteRequest, choose
from jserve.routing.prefix_memory import PrefixMemory
from jserve.routing.sent import SentLedger
from jserve.serving.app import Server, ServerConfig
from jserve.serving.route_prompt import model_tokenizer, route_prompt

log = logging.getLogger(__name__)
REPLICA_HEADER = "x-jserve-replica"
# The last routing decisions made in this process (the ingress's): what it saw and chose.
DECISIONS: collections.deque = collections.deque(maxlen=256)
DECISION_NUMBERS = itertools.count(1)  # each decision's "n": what came after a given one
_RETRYABLE = (ActorDiedError, ActorUnavailableError, RayActorError)


def route_info(prompt_ids, ttft_slo: float | None = None) -> dict:
    """What the router reads of a request (the first argument of ``JServeReplica.handle``):
    plain data, since the router and the ingress may hold different copies of this module's
    classes."""
    return {"jserve_route": True, "prompt_ids": [int(t) for t in prompt_ids],
            "ttft_slo": ttft_slo}


class JServeRouter(FIFOMixin, RequestRouter):
    """Ray Serve's request-router API over ``jserve.routing.choose``."""

    def initialize_state(self, policy: str = "deadline", page_size: int = 16):
        if policy not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {policy!r}")
        self.policy = policy
        self.memory = PrefixMemory(page_size)
        self._seq = itertools.count()
        self._sent = SentLedger()  # what each replica's last report may not show yet

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self.memory.forget(replica_id.unique_id)
        self._sent.forget(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        route = (pending_request.args[0] if pending_request is not None and pending_request.args
                 else None)
        if not isinstance(route, dict) or not route.get("jserve_route") or \
                not candidate_replicas:
            return [candidate_replicas]
        ids, slo = route["prompt_ids"], route["ttft_slo"]
        views = []
        for r in candidate_replicas:
            stats, name = r.routing_stats, r.replica_id.unique_id
            load = (ReplicaLoad.from_dict(stats) if "table" in stats else ReplicaLoad.unknown(name))
            load = self._sent.with_unreported(dataclasses.replace(load, replica=name),
                                              stats.get("reported_at", 0.0))
            views.append(ReplicaView(load, self.memory.cached_tokens(name, ids)))
        request = RouteRequest(len(ids), slo, next(self._seq))
        k = choose(self.policy, request, views)
        chosen = candidate_replicas[k]
        self.memory.record(chosen.replica_id.unique_id, ids)
        self._sent.record(chosen.replica_id.unique_id, request.prompt_tokens,
                          views[k].cached_tokens, slo)
        # Ray may hold this class as a pickled copy with globals of its own: record into the
        # module the ingress reads.
        from jserve.serving import ray_app
        ray_app.DECISIONS.append({"n": next(ray_app.DECISION_NUMBERS), "policy": self.policy,
                          "request": dataclasses.asdict(request),
                          "loads": [v.load.to_dict() for v in views],
                          "cached": [v.cached_tokens for v in views],
                          "replicas": [r.replica_id.unique_id for r in candidate_replicas],
                          "chosen": chosen.replica_id.unique_id})
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]


class JServeReplica:
    """One engine and jserve's OpenAI app, called in process (no ports)."""

    def __init__(self, model: str, engine_kwargs: dict, server_kwargs: dict):
        # Imported here: the model loads JAX, which the ingress and the router (this module
        # too) never need.
        from jserve.serving.live_engine import EngineSpec, build_engine

        kw = dict(engine_kwargs)  # (``dtype`` among them, as ``jserve serve --ray`` gives it)
        self.engine = build_engine(EngineSpec(model, kw.pop("dtype", "auto"), kw))
        self.config = ServerConfig(port=None, http_port=None, metrics_port=None,
                                   **server_kwargs)
        self.server = Server(self.engine, self.config)
        self.http = self.server.http
        self.name = serve.get_replica_context().replica_id.unique_id
        self._started = False

    def _start(self) -> None:
        if not self._started:
            self.server.start_engine(asyncio.get_running_loop())
            self._started = True

    async def handle(self, route: dict | None, method: str, path: str,
                     headers: list[tuple[bytes, bytes]], body: bytes) -> AsyncIterator[Any]:
        """Runs one HTTP request through the OpenAI app: yields the response head
        (``{"status", "headers"}``), then its body chunks."""
        self._start()
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await out.put(message)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "headers": headers,
                 "client": ("ray", 0), "server": ("ray", 0)}
        task = asyncio.ensure_future(self.http.asgi(scope, receive, send))
        try:
            while True:
                getter = asyncio.ensure_future(out.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    task.result()  # raises what the app raised
                    return
                m = getter.result()
                if m["type"] == "http.response.start":
                    yield {"status": m["status"], "replica": self.name, "headers": [
                        (k.decode("latin-1"), v.decode("latin-1")) for k, v in m["headers"]]}
                elif m["type"] == "http.response.body":
                    if m.get("body"):
                        yield m["body"]
                    if not m.get("more_body", False):
                        return
        finally:
            gone.set()  # a caller that left: the app aborts the engine requests
            if not task.done():
                with contextlib.suppress(Exception):
                    await task

    async def record_routing_stats(self) -> dict:
        """Ray's routing stats of this replica: its ``ReplicaLoad``."""
        self._start()
        load = await self.server.engine.load_report(  # the report is as of now
            self.name, healthy=self.server.gateway.healthy)
        return dict(load.to_dict(), reported_at=time.time())

    async def check_health(self) -> None:
        if self._started and not self.server.engine.alive:
            raise RuntimeError("the engine thread is gone")


class Ingress:
    """Ray's HTTP proxy calls this for every request; it picks nothing itself (the handle's
    ``JServeRouter`` does) and retries a request whose replica died before answering."""

    def __init__(self, replica, model: str, retries: int = 2):
        self.handle = replica.options(stream=True)
        self.tokenizer = model_tokenizer(model)
        self.retries = retries

    def _route(self, path: str, body: bytes) -> dict | None:
        prompt = route_prompt(self.tokenizer, path, body)
        return None if prompt is None else route_info(*prompt)

    async def __call__(self, request: Request):
        """``GET /v1/route/decisions``: the router's recent decisions (what it saw of each
        replica, and where it sent the request); anything else goes to a replica."""
        body = await request.body()
        path = request.url.path
        if path == "/v1/route/decisions" and request.method == "GET":
            from jserve.serving import ray_app  # the module, not a pickled copy of it
            return JSONResponse(list(ray_app.DECISIONS))
        route = self._route(path, body)
        headers = [(k.encode("latin-1"), v.encode("latin-1"))
                   for k, v in request.headers.items()]
        for attempt in range(self.retries + 1):
            stream = self.handle.handle.remote(route, request.method, path, headers, body)
            try:
                head = await stream.__anext__()
            except _RETRYABLE as e:
                if attempt == self.retries:
                    return JSONResponse({"error": {
                        "message": f"no replica could take the request: {e}",
                        "type": "unavailable", "code": "unavailable"}}, status_code=503)
                log.warning("replica died before answering; sending the request again")
                continue
            except StopAsyncIteration:
                return JSONResponse({"error": {"message": "the replica sent no response",
                                               "type": "internal", "code": "internal"}},
                                    status_code=500)
            hdrs = dict(head["headers"])
            hdrs.pop("content-length", None)
            hdrs[REPLICA_HEADER] = head["replica"]
            return StreamingResponse(_body(stream), status_code=head["status"], headers=hdrs)


async def _body(stream) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield chunk
    except _RETRYABLE as e:  # mid-response: the client gets what came, then an error event
        yield ("data: " + json.dumps({"error": {"message": f"replica died: {e}",
                                                "type": "unavailable"}}) + "\n\n").encode()


def _object_arg(args: dict, key: str) -> dict:
    """An application argument that is a JSON object: a string from ``serve run ...
    key='{...}'``, or a dict from Python."""
    v = args.get(key, {})
    return json.loads(v) if isinstance(v, str) else dict(v)


def build_app(args: dict | None = None):
    """The application: ``args`` (strings from ``serve run ... key=value`` or values):
    ``model`` ("default"), ``replicas`` (2), ``router`` ("deadline"), ``engine`` (a JSON
    object of ``LLM`` keyword arguments; ``dtype`` ``auto`` resolved as ``jserve serve``
    resolves it), ``server`` (of ``ServerConfig`` fields),
    ``stats_period_s`` (0.2), ``num_cpus`` / ``num_gpus`` per replica, ``max_ongoing``
    (requests Ray lets a replica hold; default the engine's ``max_num_seqs``, its batch:
    beyond it the router holds them and routes each on fresher reports),
    ``ingress_max_ongoing`` (4096), ``autoscale``
    ("MIN,MAX" replicas on Ray's ongoing-requests target ``target_ongoing`` (4)) with
    ``autoscaling`` (a JSON object of further ``AutoscalingConfig`` fields, e.g.
    ``upscale_delay_s``, ``downscale_delay_s``, ``look_back_period_s``)."""
    a = dict(args or {})
    model = a.get("model", "default")
    engine = _object_arg(a, "engine")
    server = _object_arg(a, "server")
    if "served_model_names" in server:
        server["served_model_names"] = tuple(server["served_model_names"])
    else:
        server["served_model_names"] = (model,)
    router = a.get("router", "deadline")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    options: dict[str, Any] = dict(
        ray_actor_options={"num_cpus": float(a.get("num_cpus", 1)),
                           "num_gpus": float(a.get("num_gpus", 0))},
        graceful_shutdown_timeout_s=float(a.get("grace_s", 60)),
        request_router_config=RequestRouterConfig(
            request_router_class="jserve.serving.ray_app.JServeRouter",
            request_router_kwargs={"policy": router},
            request_routing_stats_period_s=float(a.get("stats_period_s", 0.2)),
            request_routing_stats_timeout_s=float(a.get("stats_timeout_s", 5.0))))
    # Ray's own default (5) would cap every replica's batch at 5 sequences.
    options["max_ongoing_requests"] = int(a.get("max_ongoing") or engine.get(
        "max_num_seqs", EngineConfig.max_num_seqs))
    if a.get("autoscale"):
        lo, hi = (int(x) for x in str(a["autoscale"]).split(","))
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=lo, max_replicas=hi,
            target_ongoing_requests=float(a.get("target_ongoing", 4)),
            **_object_arg(a, "autoscaling"))
    else:
        options["num_replicas"] = int(a.get("replicas", 2))
    replica = serve.deployment(JServeReplica, name="JServeReplica", **options).bind(
        model, engine, server)
    # The ingress only awaits replicas: Ray's default of 5 ongoing requests would cap the
    # whole service at 5 (a sixth request, even GET /v1/route/decisions, queued in the proxy).
    ingress = serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=int(a.get("ingress_max_ongoing", 4096))
                               ).bind(replica, model)
    return ingress


app = build_app


def run(args: dict, host: str = "127.0.0.1", port: int = 8000, ready=None) -> int:
    """``jserve serve --ray``: starts (or joins) a Ray cluster, serves the application on
    ``host:port`` until SIGTERM or SIGINT, then shuts Serve down (replicas finish what they
    accepted)."""
    ray.init(address=args.pop("address", None), ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(args), name="jserve", route_prefix="/")
    if ready is not None:
        ready()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):  # a bare wait() would not see the signal
        pass
    serve.shutdown()
    ray.shutdown()
    return 0

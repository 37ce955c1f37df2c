"""The engine processes behind ``jserve serve --data-parallel-size N``: each a whole
``jserve serve`` of its own (its own devices or, on CPU, its own process), on a loopback port
that only the front end (``jserve.serving.front``) talks to.

An engine has a role: ``both`` (it prefills and decodes, the colocated default), ``prefill``
(only the prompts the router disaggregates: its pages go to a decode engine) or ``decode``.
Every engine with a prefill role exports pages and every other imports them from the
prefill engines (``--kv-transfer-config``, set here for each). The front end reads each
engine's ``/v1/route/load`` every ``POLL_S``; an engine whose process ends, or that
answers no poll for ``DEAD_AFTER_S``, is out (``state`` dead) and gets no more requests.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jserve.routing.load import ReplicaLoad
from jserve.serving.kv_params import CONNECTOR

log = logging.getLogger(__name__)

ENGINE_ROLES = ("both", "prefill", "decode")  # KV_ROLE: their kv_role
KV_ROLE = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}
POLL_S = 0.1
DEAD_AFTER_S = 5.0
STARTING, READY, DRAINING, DEAD = "starting", "ready", "draining", "dead"


@dataclasses.dataclass(eq=False)
class Engine:
    index: int
    role: str
    url: str
    proc: subprocess.Popen | None = None
    state: str = STARTING
    load: ReplicaLoad | None = None
    reported_at: float = 0.0      # wall time of ``load``
    kv: dict | None = None        # its ``/v1/route/load`` kv_transfer report
    last_answer: float = dataclasses.field(default_factory=time.monotonic)
    why: str = ""                 # why it is out, once it is
    grpc_target: str | None = None  # its gRPC address, once its serving line gave it

    @property
    def name(self) -> str:
        return f"engine{self.index}"

    @property
    def prefills_only(self) -> bool:
        return self.role == "prefill"

    @property
    def takes_requests(self) -> bool:
        return self.state == READY

    def out(self, why: str) -> None:
        if self.state != DEAD:
            log.warning("%s (%s) is out: %s", self.name, self.url, why)
        self.state, self.why = DEAD, why

    def describe(self) -> dict:
        return {"index": self.index, "name": self.name, "role": self.role, "url": self.url,
                "state": self.state, "pid": self.proc.pid if self.proc else None,
                "why": self.why or None,
                "load": None if self.load is None else {
                    "waiting": self.load.waiting, "running": self.load.running,
                    "kv_usage": self.load.kv_usage, "healthy": self.load.healthy}}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def roles(engines: int, prefill_engines: int) -> list[str]:
    """Each engine's role: the first ``prefill_engines`` prefill, the rest decode (or all
    both when none prefills)."""
    if not 0 <= prefill_engines < engines:
        raise ValueError(f"--prefill-engines must be >= 0 and leave a decode engine (of "
                         f"{engines}), got {prefill_engines}")
    return ["prefill"] * prefill_engines + [
        "decode" if prefill_engines else "both"] * (engines - prefill_engines)


def kv_transfer_config(role: str, prefill_urls: list[str], timeout_s: float) -> str:
    extra = {"peers": [] if role == "prefill" else prefill_urls, "timeout_s": timeout_s}
    return json.dumps({"kv_connector": CONNECTOR, "kv_role": KV_ROLE[role],
                       "kv_connector_extra_config": extra})


def launch(argv: list[str], engine_roles: list[str], *, transfer_timeout_s: float = 30.0,
           devices_per_engine: int | None = None) -> list[Engine]:
    """Starts one ``jserve serve`` per role, each with ``argv`` (the front end's own serve
    arguments) and its own loopback port, no gRPC and no separate metrics port; returns them
    starting (``wait_ready`` waits). ``devices_per_engine``: engine i sees accelerators
    [i*k, (i+1)*k) (``CUDA_VISIBLE_DEVICES``, ``TPU_VISIBLE_CHIPS``); None: all see all."""
    ports = [free_port() for _ in engine_roles]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    prefill_urls = [u for u, r in zip(urls, engine_roles) if r == "prefill"]
    engines = []
    for i, (role, port, url) in enumerate(zip(engine_roles, ports, urls)):
        env = dict(os.environ, JSERVE_ENGINE_INDEX=str(i))
        if devices_per_engine:
            ids = ",".join(str(d) for d in range(i * devices_per_engine,
                                                 (i + 1) * devices_per_engine))
            env.update(CUDA_VISIBLE_DEVICES=ids, TPU_VISIBLE_CHIPS=ids)
        cmd = [sys.executable, "-m", "jserve.cli", "serve", *argv,
               "--data-parallel-size", "1", "--prefill-engines", "0",
               "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
               "--metrics-port", "-1", "--drain-notice", "0",
               "--kv-transfer-config", kv_transfer_config(role, prefill_urls,
                                                          transfer_timeout_s)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        e = Engine(i, role, url, proc)
        threading.Thread(target=_relay, args=(e,), daemon=True).start()
        engines.append(e)
    return engines


def _relay(e: Engine) -> None:
    """The engine's stdout, a line at a time, to the log; its ``serving`` line marks it
    ready (its ports are bound)."""
    for line in e.proc.stdout:
        line = line.rstrip()
        if line.startswith("jserve: serving") and e.state == STARTING:
            m = re.match(r"jserve: serving .* on ([\d.]+:\d+) ", line)
            e.grpc_target = m.group(1) if m else None
            e.state = READY
            e.last_answer = time.monotonic()
        log.info("[%s] %s", e.name, line)


def wait_ready(engines: list[Engine], timeout_s: float = 600.0) -> None:
    """Returns once every engine is ready; RuntimeError naming the first that exited (or
    the ones still starting after ``timeout_s``)."""
    end = time.monotonic() + timeout_s
    while any(e.state == STARTING for e in engines):
        for e in engines:
            if e.proc.poll() is not None:
                raise RuntimeError(f"{e.name} exited with {e.proc.returncode} while starting")
        if time.monotonic() > end:
            raise RuntimeError("engines still starting after %.0f s: %s" % (
                timeout_s, [e.name for e in engines if e.state == STARTING]))
        time.sleep(0.05)


def server_info(e: Engine, auth_token: str | None = None) -> dict:
    """An engine's ``/server_info`` (its page size, the model it serves)."""
    import urllib.request
    headers = {"authorization": f"Bearer {auth_token}"} if auth_token else {}
    with urllib.request.urlopen(urllib.request.Request(e.url + "/server_info",
                                                       headers=headers), timeout=30) as r:
        return json.loads(r.read())


def stop(engines: list[Engine], grace_s: float) -> None:
    """SIGTERM to every engine still running (each drains: requests in flight finish within
    its own grace period), then SIGKILL to any left after ``grace_s``."""
    live = [e for e in engines if e.proc is not None and e.proc.poll() is None]
    for e in live:
        e.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for e in live:
        try:
            e.proc.wait(max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            e.proc.kill()
            e.proc.wait()

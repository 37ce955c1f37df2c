"""Live routing benchmark (``scripts/bench_routing.py live``): two ``jserve serve`` replicas
(the built-in model, small batches) on loopback, a heterogeneous open-loop trace (documents
asked three times among short chats), and each router's short-request TTFT, SLO attainment
and prefix hit rate: jserve's routers (``jserve.routing.choose`` on each replica's
``/v1/route/wait`` answer) and SGLang's gateway (``smg``, cache-aware)."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from jserve.bench.metrics import percentile
from jserve.routing import ROUTERS, ReplicaLoad, ReplicaView, RouteRequest, choose

_ROOT = Path(__file__).resolve().parents[2]  # the checkout whose jserve the replicas run

SERVE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64",
         "--max-model-len", "2048", "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port",
         "-1"]


LIVE_ROUTERS = ROUTERS + ("smg",)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_replica() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jserve.cli", "serve", *SERVE,
                             "--http-port", str(port)], cwd=_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    proc.stdout.readline()  # the "serving" line: the ports are bound
    return proc, f"http://127.0.0.1:{port}"


def _start_smg(urls: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    smg = str(Path(sys.executable).parent / "smg")
    proc = subprocess.Popen([smg, "launch", "--host", "127.0.0.1", "--port", str(port),
                             "--policy", "cache_aware", "--worker-urls", *urls,
                             "--disable-tokenizer-autoload", "--log-level", "warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/readiness", timeout=2).json().get("healthy_workers") == 2:
                return proc, url
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError("smg did not get ready")


def _counters(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
                out[s.name] = s.value
    return out


@dataclasses.dataclass(frozen=True)
class LiveRequest:
    at: float
    prompt: str
    short: bool


def live_trace(n: int, qps: float, seed: int) -> list[LiveRequest]:
    """Per 8 requests: 3 asks of one ~1,200-token document and 5 short chats."""
    rng = random.Random(seed)
    out, t, doc = [], 0.0, None
    for i in range(n):
        t += rng.expovariate(qps)
        if i % 8 == 0:
            doc = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(1200))
        if i % 8 in (0, 3, 6):
            out.append(LiveRequest(t, f"{doc}\nQuestion {i}: what is it about?", False))
        else:
            out.append(LiveRequest(t, f"chat {i}: say hi {rng.randint(0, 999)}", True))
    return out


async def _stream(client: httpx.AsyncClient, url: str, prompt: str) -> float:
    """When (``time.perf_counter``) the first streamed token came."""
    async with client.stream("POST", url + "/v1/completions", json={
            "model": "default", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = time.perf_counter()
        if r.status_code != 200 or first is None:
            raise RuntimeError(f"{url}: status {r.status_code}")
        return first


async def _pick(client: httpx.AsyncClient, router: str, urls: list[str], prompt: str,
                seq: int) -> str:
    """This script's router: every replica's /v1/route/wait answer, then jserve.routing."""
    answers = await asyncio.gather(*(client.post(u + "/v1/route/wait", json={"prompt": prompt})
                                     for u in urls))
    views = [ReplicaView(ReplicaLoad.from_dict(a.json()["load"]), a.json()["cached_tokens"])
             for a in answers]
    n = answers[0].json()["prompt_tokens"]
    return urls[choose(router, RouteRequest(n, None, seq), views)]


async def _run_live(router: str, urls: list[str], gateway: str | None,
                    trace: list[LiveRequest]) -> list[tuple[bool, float]]:
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.perf_counter()

        async def one(i: int, r: LiveRequest) -> tuple[bool, float]:
            await asyncio.sleep(max(r.at - (time.perf_counter() - t0), 0))
            start = time.perf_counter()
            url = gateway if router == "smg" else await _pick(client, router, urls,
                                                                  r.prompt, i)
            # TTFT from the request's arrival at the router (its routing included).
            return r.short, await _stream(client, url, r.prompt) - start
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))


def live(a) -> dict:
    replicas = [_start_replica() for _ in range(2)]
    urls = [u for _, u in replicas]
    smg = _start_smg(urls)
    try:
        warm = live_trace(16, 50.0, 12345)  # compile every shape the trace uses
        asyncio.run(_run_live("round_robin", urls, None, warm))
        idle = [asyncio.run(_run_live("round_robin", urls, None, [LiveRequest(0, "hi", True)]))
                [0][1] for _ in range(5)]
        rows = {r: [] for r in LIVE_ROUTERS}
        # Each repetition runs the routers in a rotated order (none always goes first).
        runs = [(rep, LIVE_ROUTERS[(i + rep) % len(LIVE_ROUTERS)]) for rep in range(a.reps)
                for i in range(len(LIVE_ROUTERS))]
        for rep, router in tqdm(runs, desc="live runs"):
            trace = live_trace(a.requests, a.qps, seed=1000 * rep + LIVE_ROUTERS.index(router))
            before = [_counters(u) for u in urls]
            t0 = time.perf_counter()
            res = asyncio.run(_run_live(router, urls, smg[1], trace))
            wall = time.perf_counter() - t0
            after = [_counters(u) for u in urls]
            q = sum(x["vllm:prefix_cache_queries_total"] - y["vllm:prefix_cache_queries_total"]
                    for x, y in zip(after, before))
            h = sum(x["vllm:prefix_cache_hits_total"] - y["vllm:prefix_cache_hits_total"]
                    for x, y in zip(after, before))
            short = [t for s, t in res if s]
            rows[router].append({"short_ttft_p50": percentile(short, 50),
                                 "short_ttft_p90": percentile(short, 90),
                                 "short_attainment": sum(t <= a.short_slo for t in short)
                                 / len(short),
                                 "prefix_hit_rate": h / q if q else 0.0, "wall_s": wall})
        table = {r: {k: statistics.median(x[k] for x in v) for k in v[0]}
                 for r, v in rows.items()}
        return {"idle_short_ttft_median": statistics.median(idle), "short_slo": a.short_slo,
                "requests": a.requests, "qps": a.qps, "reps": a.reps, "table": table,
                "runs": rows}
    finally:
        smg[0].send_signal(signal.SIGKILL)
        for p, _ in replicas:
            p.send_signal(signal.SIGTERM)
        for p, _ in replicas:
            p.wait(30)

"""Routing across replicas, compared per router: live on this machine and simulated at scale.

    python scripts/bench_routing.py live [--requests 48] [--qps 3] [--reps 3]
    python scripts/bench_routing.py sim  [--requests 600] [--qps 20]
    python scripts/bench_routing.py all  (both; writes docs/scale_out/bench_routing.json)

(a) live: two ``jserve serve`` replicas (the built-in model, small batches) on loopback; a
heterogeneous open-loop trace (Poisson arrivals): documents of ~1,200 tokens each asked three
times (shared prefixes) among short chats. Routers: ``round_robin``, ``least_load``,
``prefix``, ``deadline`` (``jserve.routing.choose`` on each replica's ``/v1/route/wait`` answer,
asked per request by this script's router, which then streams from the chosen replica), and
``smg`` (SGLang's gateway, ``--policy cache_aware``). Each router runs ``--reps`` times with
fresh document texts (the replicas' caches never hold an earlier run's documents); the figures
are the medians over repetitions of: short-request TTFT P50 / P90, short SLO attainment (TTFT
within ``--short-slo``), and the prefix hit rate (prompt tokens found cached / looked up, from
the replicas' ``vllm:prefix_cache_*`` counters).

(b) sim: 4 replicas of Llama-3 8B on TP8 x SPP2 A100 meshes (64 GPUs) behind each router
(``jserve.sim.cluster``), once per replica scheduler (``--replica-policies``: ``lars-ss``, and
``sarathi``, the FIFO chunked prefill of vLLM-like replicas) and share of long documents
(``--long-fractions``: 5%, the Medha-scale trace, and 1%); the trace is
``jserve.bench.workload``'s ShareGPT4 chats with Medha-SWE-like 128K-1M documents, with half
of every chat of 256+ tokens a shared system prompt (8 of them; prefix caching on). Each
router's goodput: the highest QPS (geometric bisection to ``--rel-tol``) at which 90% of short
requests meet their TTFT deadline (the deadline policies' default, max(1.5 x isolated prefill,
0.5 s)); then every router's row (TTFT, short and long attainment) at the best load- or
prefix-based router's goodput.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jserve.bench.metrics import LONG_PROMPT_TOKENS, percentile  # noqa: E402
from jserve.routing import ROUTERS, ReplicaLoad, ReplicaView, RouteRequest, choose  # noqa: E402

SERVE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64",
         "--max-model-len", "2048", "--host", "127.0.0.1", "--port", "0", "--metrics-port",
         "-1"]
LIVE_ROUTERS = ROUTERS + ("smg",)


# -- (a) live ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_replica() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jserve.cli", "serve", *SERVE,
                             "--http-port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
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


# -- (b) sim ----------------------------------------------------------------------------------
def sim_trace(n: int, qps: float, seed: int, long_fraction: float = 0.05):
    from jserve.bench.workload import WorkloadSpec, build_workload
    out = []
    for t in build_workload(WorkloadSpec(num_requests=n, long_fraction=long_fraction, qps=qps,
                                         seed=seed)):
        if t.prompt_tokens < LONG_PROMPT_TOKENS and t.prompt_tokens >= 256:
            t = dataclasses.replace(t, prefix_id=f"system{int(t.request_id) % 8}",
                                    prefix_tokens=t.prompt_tokens // 2)
        out.append(t)
    return out


REPLICAS = 4


def _sim_cfg(pooled: bool = False):
    """The replicas' mesh; ``pooled``: one replica with the cluster's compute, KV, batch and
    sequence slots, run in time slowed ``REPLICAS``x (see ``_pooled_once``)."""
    from jserve.sim.policies import SimConfig, _time_model
    cfg = SimConfig(model="llama3-8b", hardware="a100", tp=8, spp=2, prefix_caching=True)
    if not pooled:
        return cfg
    kv = _time_model(cfg.model, cfg.hardware, cfg.tp, cfg.spp, cfg.kvp).kv_cache_tokens(
        cfg.memory_fraction)
    return dataclasses.replace(
        cfg, iteration_budget=cfg.iteration_budget * REPLICAS, kv_cache_tokens=kv * REPLICAS,
        max_num_seqs=cfg.max_num_seqs * REPLICAS,
        max_num_batched_tokens=cfg.max_num_batched_tokens * REPLICAS,
        max_prefill_seqs=cfg.max_prefill_seqs * REPLICAS)


def _full_share(recs: list[dict], missed: list[dict], slots: int) -> float:
    """The share of ``missed`` that arrived while their replica held at least ``slots``
    unfinished requests (its sequence slots full: they waited for one)."""
    if not missed:
        return 0.0
    by = {}
    for r in recs:
        a, f = by.setdefault(r.get("replica", 0), ([], []))
        a.append(r["arrival_s"])
        f.append(r["finish_s"] if r["finish_s"] is not None else float("inf"))
    by = {k: (np.sort(a), np.sort(f)) for k, (a, f) in by.items()}
    full = 0
    for r in missed:
        a, f = by[r.get("replica", 0)]
        t = r["arrival_s"]
        full += (np.searchsorted(a, t, "left") - np.searchsorted(f, t, "right")) >= slots
    return full / len(missed)


def _long_everywhere_share(recs: list[dict], missed: list[dict], long_tokens: int,
                           replicas: int) -> float:
    """The share of ``missed`` that arrived while every replica had a long prompt between its
    arrival and its first token (on FIFO replicas a newcomer waits behind it wherever it
    goes: no choice of replica for the short request could avoid a document's prefill)."""
    if not missed:
        return 0.0
    spans: dict = {}
    for r in recs:
        if r["prompt_tokens"] >= long_tokens:
            end = r["first_token_s"] if r["first_token_s"] is not None else float("inf")
            spans.setdefault(r.get("replica", 0), []).append((r["arrival_s"], end))
    if len(spans) < replicas:
        return 0.0
    busy = lambda k, t: any(a <= t < e for a, e in spans[k])  # noqa: E731
    return sum(all(busy(k, r["arrival_s"]) for k in spans) for r in missed) / len(missed)


def _sim_once(router: str, n: int, qps: float, seed: int, policy: str = "lars-ss",
              long_fraction: float = 0.05) -> dict:
    """One simulated run: ``router`` over ``REPLICAS`` replicas, or (``router="pooled"``) the
    pooled replica. A pooled replica REPLICAS times as fast as one serves a trace at ``qps``
    as one of today's serves it at ``qps / REPLICAS`` with every time stretched REPLICAS x:
    its iteration budget, and the TTFT floor of its deadlines (max(1.5 x isolated prefill,
    REPLICAS x 0.5 s)), so its attainment is that run's."""
    from jserve.scheduler.deadline import DeadlineConfig
    from jserve.sim.cluster import run_cluster
    from jserve.sim.goodput import GoodputSlo, attainment
    from jserve.sim.policies import default_ttft_deadlines, isolated_ttfts
    pooled = router == "pooled"
    cfg = _sim_cfg(pooled)
    if pooled:
        trace = sim_trace(n, qps / REPLICAS, seed, long_fraction)
        k, floor = DeadlineConfig.ttft_k, DeadlineConfig.ttft_floor
        trace = [dataclasses.replace(t, ttft_deadline_s=max(k * alone, REPLICAS * floor))
                 for t, alone in zip(trace, isolated_ttfts(trace, cfg))]
        recs = run_cluster(trace, policy, "round_robin", 1, cfg)
    else:
        trace = sim_trace(n, qps, seed, long_fraction)
        recs = run_cluster(trace, policy, router, REPLICAS, cfg)
    due = default_ttft_deadlines(trace, cfg)
    slo = GoodputSlo()
    short = [(r, d) for r, d in zip(recs, due) if r["prompt_tokens"] < slo.long_prompt_tokens]
    ttft = [r["first_token_s"] - r["arrival_s"] if r["first_token_s"] is not None
            else float("inf") for r, _ in short]
    missed = [r for (r, d), t in zip(short, ttft) if t > d]
    met = attainment(recs, due, slo)  # the TTFT classes; its TPOT share is unused
    out = {"short_ttft_p50": percentile(ttft, 50), "short_ttft_p90": percentile(ttft, 90),
           "short_attainment": met["short"], "long_attainment": met["long"],
           "missed_with_slots_full": _full_share(recs, missed, cfg.max_num_seqs),
           "missed_with_long_everywhere": _long_everywhere_share(
               recs, missed, slo.long_prompt_tokens, 1 if pooled else REPLICAS)}
    if pooled:  # its times in the pooled replica's own clock
        out["short_ttft_p50"] /= REPLICAS
        out["short_ttft_p90"] /= REPLICAS
    return out


def _sim_mean(router: str, a, qps: float, policy: str, long_fraction: float) -> dict:
    """``_sim_once`` over every seed of ``--seeds``, each figure the mean (one trace's
    attainment is not monotone in QPS; several smooth the bisection)."""
    runs = [_sim_once(router, a.sim_requests, qps, s, policy, long_fraction) for s in a.seeds]
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


def _goodput(router: str, a, policy: str, long_fraction: float) -> float:
    """Highest QPS with >= 90% short attainment (``jserve.sim.goodput.bisect_goodput``:
    geometric, so the resolution is the same ratio at 1 req/s as at 30)."""
    from jserve.sim.goodput import bisect_goodput
    return bisect_goodput(lambda q: _sim_mean(router, a, q, policy,
                                              long_fraction)["short_attainment"] >= 0.9,
                          a.lo, a.hi, rel_tol=a.rel_tol)


def sim(a) -> dict:
    """Per replica scheduler and long-document share: each router's goodput, then every
    router's row at the best load- or prefix-based router's goodput."""
    configs = {}
    routers = [r for r in a.routers.split(",") if r]
    for policy in a.replica_policies.split(","):
        for lf in (float(x) for x in a.long_fractions.split(",")):
            # --table-qps: only the rows at that rate (why requests miss there), no goodput.
            good = {r: None if a.table_qps else _goodput(r, a, policy, lf)
                    for r in tqdm(routers, desc=f"goodput {policy} long {lf}")}
            others = [good[r] or 0.0 for r in routers if r not in ("deadline", "pooled")]
            base = max(others) if others else 0.0
            at = a.table_qps or (base if base > 0 else a.lo / 4)
            table = {r: dict(_sim_mean(r, a, at, policy, lf), goodput_qps=good[r])
                     for r in routers}
            configs[f"{policy} long={lf}"] = {
                "policy": policy, "long_fraction": lf, "table_qps": at, "table": table,
                "deadline_over_best_baseline": (good["deadline"] / base
                                                if base and good.get("deadline") else None)}
    return {"requests": a.sim_requests, "bracket": [a.lo, a.hi], "rel_tol": a.rel_tol,
            "seeds": a.seeds, "configs": configs}


def _fmt(table: dict, cols: list[str]) -> str:
    lines = ["| router | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r, row in table.items():
        lines.append(f"| {r} | " + " | ".join(
            "-" if row.get(c) is None else f"{row[c]:.3f}" for c in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("what", choices=("live", "sim", "all"))
    p.add_argument("--requests", type=int, default=48, help="live: requests a run")
    p.add_argument("--qps", type=float, default=3.0, help="live: Poisson arrival rate")
    p.add_argument("--reps", type=int, default=3, help="live: runs per router (median)")
    p.add_argument("--short-slo", type=float, default=0.25, help="live: short TTFT SLO (s)")
    p.add_argument("--sim-requests", type=int, default=600)
    p.add_argument("--replica-policies", default="lars-ss,sarathi",
                   help="sim: each replica's scheduler (comma list; one table each)")
    p.add_argument("--long-fractions", default="0.05,0.01",
                   help="sim: shares of 128K-1M-token documents (comma list)")
    p.add_argument("--lo", type=float, default=2.0, help="sim: goodput search's first bracket")
    p.add_argument("--table-qps", type=float, default=None,
                   help="sim: only each router's row at this rate (no goodput search)")
    p.add_argument("--hi", type=float, default=8.0)
    p.add_argument("--rel-tol", type=float, default=0.1, help="sim: goodput resolution (ratio)")
    p.add_argument("--seeds", default="0",
                   help="sim: trace seeds (comma list); every probe runs each, figures are means")
    p.add_argument("--routers", default=",".join(ROUTERS),
                   help="sim: routers to compare (comma list); 'pooled' adds one replica with "
                   "the cluster's compute, KV and slots")
    p.add_argument("--out", default=str(ROOT / "docs" / "scale_out" / "bench_routing.json"))
    a = p.parse_args()
    a.seeds = [int(x) for x in a.seeds.split(",")]
    # A run of one part keeps the other part's last figures in the file.
    prev = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    out = {"command": " ".join(["python", "scripts/bench_routing.py", *sys.argv[1:]]),
           "uptime_before": os.popen("uptime").read().strip()}
    out.update({k: prev[k] for k in ("live", "sim") if k in prev and a.what not in (k, "all")})
    if a.what in ("live", "all"):
        out["live"] = live(a)
        print(_fmt(out["live"]["table"], ["short_ttft_p50", "short_ttft_p90",
                                           "short_attainment", "prefix_hit_rate"]))
    if a.what in ("sim", "all"):
        out["sim"] = sim(a)
        for name, c in out["sim"]["configs"].items():
            print(f"{name} (rows at {c['table_qps']:.2f} req/s)")
            print(_fmt(c["table"], ["short_ttft_p50", "short_ttft_p90", "short_attainment",
                                    "long_attainment", "missed_with_slots_full",
                                    "missed_with_long_everywhere", "goodput_qps"]))
    out["uptime_after"] = os.popen("uptime").read().strip()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

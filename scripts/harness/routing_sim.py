"""Simulated routing benchmark (``scripts/bench_routing.py sim``): replicas of Llama-3 8B on
TP8 x SPP2 A100 meshes behind each router (``jserve.sim.cluster``), per replica scheduler and
share of long documents; each router's goodput (the highest QPS at which 90% of short
requests meet their TTFT deadline) and every router's row at the best baseline's goodput,
with why the short requests that missed did (slots full, a document on every replica)."""
from __future__ import annotations

import dataclasses

import numpy as np
from tqdm import tqdm

from jserve.bench.metrics import LONG_PROMPT_TOKENS, percentile


def sim_trace(n: int, qps: float, seed: int, long_fraction: float = 0.05):
    from harness.workload import WorkloadSpec, build_workload
    out = []
    for t in build_workload(WorkloadSpec(num_requests=n, long_fraction=long_fraction, qps=qps,
                                         seed=seed)):
        if t.prompt_tokens < LONG_PROMPT_TOKENS and t.prompt_tokens >= 256:
            t = dataclasses.replace(t, prefix_id=f"system{int(t.request_id) % 8}",
                                    prefix_tokens=t.prompt_tokens // 2)
        out.append(t)
    return out


REPLICAS = 4


def sim_cfg(pooled: bool = False):
    """The replicas' mesh; ``pooled``: one replica with the cluster's compute, KV, batch and
    sequence slots, run in time slowed ``REPLICAS``x (see ``sim_once``)."""
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


def full_share(recs: list[dict], missed: list[dict], slots: int) -> float:
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


def long_everywhere_share(recs: list[dict], missed: list[dict], long_tokens: int,
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


def sim_once(router: str, n: int, qps: float, seed: int, policy: str = "lars-ss",
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
    cfg = sim_cfg(pooled)
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
           "missed_with_slots_full": full_share(recs, missed, cfg.max_num_seqs),
           "missed_with_long_everywhere": long_everywhere_share(
               recs, missed, slo.long_prompt_tokens, 1 if pooled else REPLICAS)}
    if pooled:  # its times in the pooled replica's own clock
        out["short_ttft_p50"] /= REPLICAS
        out["short_ttft_p90"] /= REPLICAS
    return out


def sim_mean(router: str, a, qps: float, policy: str, long_fraction: float) -> dict:
    """``sim_once`` over every seed of ``--seeds``, each figure the mean (one trace's
    attainment is not monotone in QPS; several smooth the bisection)."""
    runs = [sim_once(router, a.sim_requests, qps, s, policy, long_fraction) for s in a.seeds]
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


def _goodput(router: str, a, policy: str, long_fraction: float) -> float:
    """Highest QPS with >= 90% short attainment (``jserve.sim.goodput.bisect_goodput``:
    geometric, so the resolution is the same ratio at 1 req/s as at 30)."""
    from jserve.sim.goodput import bisect_goodput
    return bisect_goodput(lambda q: sim_mean(router, a, q, policy,
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
            table = {r: dict(sim_mean(r, a, at, policy, lf), goodput_qps=good[r])
                     for r in routers}
            configs[f"{policy} long={lf}"] = {
                "policy": policy, "long_fraction": lf, "table_qps": at, "table": table,
                "deadline_over_best_baseline": (good["deadline"] / base
                                                if base and good.get("deadline") else None)}
    return {"requests": a.sim_requests, "bracket": [a.lo, a.hi], "rel_tol": a.rel_tol,
            "seeds": a.seeds, "configs": configs}


def table(table: dict, cols: list[str]) -> str:
    lines = ["| router | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r, row in table.items():
        lines.append(f"| {r} | " + " | ".join(
            "-" if row.get(c) is None else f"{row[c]:.3f}" for c in cols) + " |")
    return "\n".join(lines)

"""Simulated prefill/decode disaggregation (``scripts/sim_disagg.py``): the same accelerators
as colocated LARS replicas (every replica prefills and decodes, ``never``), as prefill and
decode pools with every request disaggregated (``always``) and with the choice per request
(``auto``, ``jserve.routing.disagg.place``), over pool ratios and cluster sizes, on the
routing benchmark's trace (``harness.routing_sim.sim_trace``: ShareGPT4 chats with shared
system prompts, 5% Medha-SWE-like 128K-1M documents). Each design's goodput (the highest QPS
at which 90% of short requests meet their TTFT deadline, by geometric bisection), then its row
at the colocated design's goodput."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jserve.bench.metrics import LONG_PROMPT_TOKENS, percentile, tpot

# GPUs -> (TP of one replica, replicas); the meshes cover 8-64 A100s.
MESHES = {8: (4, 2), 16: (8, 2), 32: (8, 4), 64: (8, 8)}
# replicas -> (prefill, decode) splits compared
RATIOS = {2: ((1, 1),), 4: ((1, 3), (2, 2), (3, 1)), 8: ((2, 6), (4, 4), (6, 2))}
HORIZON_S = 30.0  # seconds past the last arrival the clock runs (short requests are done)


@dataclasses.dataclass(frozen=True)
class Design:
    """``mode`` on ``prefill`` + ``decode`` replicas; colocated: 0 + all, ``never``."""

    mode: str
    prefill: int
    decode: int

    @property
    def name(self) -> str:
        if self.prefill == 0:
            return "colocated"
        return f"{self.mode} {self.prefill}:{self.decode}"


def designs(replicas: int) -> list[Design]:
    out = [Design("never", 0, replicas)]
    for p, d in RATIOS[replicas]:
        out += [Design("always", p, d), Design("auto", p, d)]
    return out


def mesh_cfg(gpus: int, horizon_s: float | None = None, max_num_seqs: int = 128):
    from jserve.sim.policies import SimConfig
    tp, _ = MESHES[gpus]
    return SimConfig(model="llama3-8b", hardware="a100", tp=tp, spp=1, prefix_caching=True,
                     horizon_s=horizon_s, max_num_seqs=max_num_seqs)


def _tpot(r: dict) -> float | None:
    """Mean seconds per output token after the first, over the tokens out by the end of the
    run (a request the horizon cut short counts by the tokens it got)."""
    times = r["token_times_s"]
    if r["finish_s"] is not None:
        return tpot(r)
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 2 else None


def summary(recs: list[dict], due: list[float]) -> dict:
    """Short requests' TTFT attainment, TTFT and TPOT P50 / P90 (inf: not reached by the
    horizon); long ones' attainment and TTFT P50; the share disaggregated."""
    from jserve.sim.goodput import GoodputSlo, attainment
    met = attainment(recs, due, GoodputSlo())
    out = {"short_attainment": met["short"], "long_attainment": met["long"]}
    for cls, keep in (("short", lambda r: r["prompt_tokens"] < LONG_PROMPT_TOKENS),
                      ("long", lambda r: r["prompt_tokens"] >= LONG_PROMPT_TOKENS)):
        rs = [r for r in recs if keep(r)]
        ttft = [r["first_token_s"] - r["arrival_s"] if r["first_token_s"] is not None
                else math.inf for r in rs]
        out[f"{cls}_ttft_p50"] = percentile(ttft, 50)
        out[f"{cls}_ttft_p90"] = percentile(ttft, 90)
        tp = [t for t in map(_tpot, rs) if t is not None]
        out[f"{cls}_tpot_p50"] = percentile(tp, 50)
        out[f"{cls}_tpot_p90"] = percentile(tp, 90)
    longs = [r for r in recs if r["prompt_tokens"] >= LONG_PROMPT_TOKENS]
    out["long_served"] = (float(np.mean([r["first_token_s"] is not None for r in longs]))
                          if longs else 1.0)
    out["disaggregated"] = float(np.mean([r.get("prefill_replica") is not None for r in recs]))
    out["recomputed"] = sum(r.get("kv_import") == "recomputed" for r in recs)
    return out


def run_one(design: Design, gpus: int, qps: float, seed: int, duration_s: float,
            long_fraction: float = 0.05, gb_per_s: float | None = None,
            max_num_seqs: int = 128) -> dict:
    """One simulated run of ``design`` on ``gpus`` GPUs: ``duration_s`` of arrivals at
    ``qps`` (a fixed number of requests would be over in a moment at a high rate, before
    the sequence slots fill: the duration keeps every rate's run as long), the clock stopped
    ``HORIZON_S`` after the last arrival."""
    from harness.routing_sim import sim_trace
    from jserve.sim.disagg import TRANSFER_GB_PER_S, run_disagg, transfer_cost
    from jserve.sim.policies import default_ttft_deadlines
    trace = sim_trace(max(round(qps * duration_s), 20), qps, seed, long_fraction)
    cfg = mesh_cfg(gpus, trace[-1].arrival_s + HORIZON_S, max_num_seqs)
    link = transfer_cost(cfg, gb_per_s or TRANSFER_GB_PER_S)
    recs = run_disagg(trace, "lars-ss", design.prefill, design.decode, design.mode, cfg, link)
    return summary(recs, default_ttft_deadlines(trace, cfg))


def median_runs(design: Design, gpus: int, qps: float, a, memo: dict | None = None) -> dict:
    """``run_one`` over every seed of ``a.seeds``, each figure the median (``memo``: runs
    already made, by rate)."""
    if memo is not None and qps in memo:
        return memo[qps]
    runs = [run_one(design, gpus, qps, s, a.duration, a.long_fraction, a.gb_per_s,
                    a.max_num_seqs) for s in a.seeds]
    out = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    if memo is not None:
        memo[qps] = out
    return out


def cell(job: tuple) -> tuple:
    """One (gpus, design) cell: its goodput (the highest QPS with >= 90% of short requests on
    time, geometric bisection from ``a.lo_per_replica`` x replicas) and its row there; for a
    process pool."""
    from jserve.sim.goodput import bisect_goodput
    gpus, design, a = job
    memo: dict = {}
    lo = a.lo_per_replica * MESHES[gpus][1]
    good = bisect_goodput(
        lambda q: median_runs(design, gpus, q, a, memo)["short_attainment"] >= 0.9,
        lo, 2 * lo, rel_tol=a.rel_tol)
    row = median_runs(design, gpus, good, a, memo) if good > 0 else {}
    return gpus, design.name, dict(row, goodput_qps=good, probes=len(memo))


def at_rate(job: tuple) -> tuple:
    """One (gpus, design) row at rate ``qps`` (the colocated design's goodput); for a pool."""
    gpus, design, a, qps = job
    return gpus, design.name, dict(median_runs(design, gpus, qps, a), qps=qps)


def markdown_at_rate(results: dict) -> str:
    """Every design at the colocated design's goodput: the short requests' attainment, TTFT
    and TPOT, and the share of documents whose first token came by the horizon."""
    cols = ("req/s", "short on time", "short TTFT P50 / P90 (s)", "short TPOT P50 / P90 (ms)",
            "disaggregated", "documents started")
    lines = ["| GPUs | design | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for gpus, rows in results.items():
        for name, r in rows.items():
            lines.append(
                f"| {gpus} | {name} | {r['qps']:.1f} | {r['short_attainment']:.3f} | "
                f"{r['short_ttft_p50']:.3f} / {r['short_ttft_p90']:.3f} | "
                f"{1e3 * r['short_tpot_p50']:.1f} / {1e3 * r['short_tpot_p90']:.1f} | "
                f"{r['disaggregated']:.0%} | {r['long_served']:.0%} |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    """The table: per cluster size and design, goodput (and over colocated) and the short
    requests' TTFT and TPOT at the design's goodput."""
    cols = ("goodput req/s", "vs colocated", "short TTFT P50 / P90 (s)",
            "short TPOT P50 / P90 (ms)", "disaggregated", "documents started")
    lines = ["| GPUs | design | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for gpus, rows in results.items():
        base = rows["colocated"]["goodput_qps"]
        best = max(r["goodput_qps"] for r in rows.values())
        for name, r in rows.items():
            if not r["goodput_qps"]:
                lines.append(f"| {gpus} | {name} | 0 | - | - | - | - | - |")
                continue
            g = f"{r['goodput_qps']:.1f}"
            g = f"**{g}**" if r["goodput_qps"] == best else g
            lines.append(
                f"| {gpus} | {name} | {g} | {r['goodput_qps'] / base:.2f}x | "
                f"{r['short_ttft_p50']:.3f} / {r['short_ttft_p90']:.3f} | "
                f"{1e3 * r['short_tpot_p50']:.1f} / {1e3 * r['short_tpot_p90']:.1f} | "
                f"{r['disaggregated']:.0%} | {r['long_served']:.0%} |")
    return "\n".join(lines)

"""Medha's figures on the simulator (``scripts/medha_reproduction.py``, docs/reproduction.md):
every simulated policy against the LoongServe and vLLM-like (``sarathi``) baselines on 16
A100s. The runs (goodput by bisection, runs at fixed loads, lars with each ordering rule off,
in worker processes), the scaling figures from the time model, and the plots."""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import statistics
import time
from pathlib import Path

import matplotlib
import numpy as np
from tqdm import tqdm

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from harness.workload import WorkloadSpec, build_workload  # noqa: E402
from jserve.bench.metrics import (  # noqa: E402
    LONG_PROMPT_TOKENS as LONG,  # noqa: E402
    Slo,
    summarize,
    ttft,
)
from jserve.data import profiles_root  # noqa: E402
from jserve.scheduler.chunking import PrefillTimeCache  # noqa: E402
from jserve.scheduler.plan import BatchPlan, ScheduledChunk  # noqa: E402
from jserve.scheduler.registry import SIMULATED_POLICIES as POLICIES  # noqa: E402
from jserve.sim.goodput import GoodputSlo, at_rate, attainment, bisect_goodput  # noqa: E402
from jserve.sim.hardware import (  # noqa: E402
    LAYER_OPS,
    GpuTimeModel,
    StageTimes,
    _Curve,
    _load_compute,
)
from jserve.sim.policies import (  # noqa: E402
    SimConfig,
    default_ttft_deadlines,
    isolated_ttfts,
    run,
    saturation,
)

MESH = SimConfig(model="llama3-8b", hardware="a100", tp=8, spp=2)


SYSTEMS = ("lars", "loongserve", "sarathi")


PAPER_QPS = 0.75


SLO = Slo(ttft_s=2.0, ttft_per_token_s=2e-4, tpot_s=0.1)  # 2 s, or 200 s for 1M tokens


# Medha vs LoongServe at 0.75 QPS: 30x P50; 174x "P99" (abstract) or "P90" (§6.4).
PAPER = {50: "30x", 90: "174x (§6.4)", 99: "174x (abstract)"}


# Goodput: 90% of shorts within 2 s, of longs within 2x their isolated TTFT, of all within
# 0.1 s TPOT; bisection to 3% between half the time model's saturation and saturation.
GOODPUT = GoodputSlo(short_ttft_s=2.0, long_ttft_factor=2.0, tpot_s=0.1, attainment=0.9,
                     long_prompt_tokens=LONG)


GOODPUT_TOL = 0.03


def workload(n: int, qps: float, seed: int):
    return build_workload(WorkloadSpec(num_requests=n, long_fraction=0.05, qps=qps, seed=seed))


# lars variants (label -> SimConfig fields): the TTFT-deadline attainment before and after
# the pipeline drain in the slack, the due-first order and quick first (jserve.scheduler.deadline).
BEFORE = "lars (paper order, no drain)"


NO_QUICK = "lars (drain + due first, no quick first)"


VARIANTS = {BEFORE: dict(due_first=False, pipeline_drain=False),
            "lars (+ drain only)": dict(due_first=False, quick_first=0.0),
            "lars (+ due first only)": dict(pipeline_drain=False, quick_first=0.0),
            NO_QUICK: dict(quick_first=0.0)}


def run_one(args: tuple[str, int, float, int]) -> dict:
    label, n, qps, seed = args
    policy = "lars" if label in VARIANTS else label
    trace = workload(n, qps, seed)
    t0 = time.perf_counter()
    records = run(trace, policy, dataclasses.replace(MESH, **VARIANTS.get(label, {})))
    s = summarize(records, slo=SLO)
    # Deadlines: the deadline policies' defaults on MESH, the same for every system.
    met = {"short": [], "long": []}
    for r, due in zip(records, default_ttft_deadlines(trace, MESH)):
        met["long" if r["prompt_tokens"] >= LONG else "short"].append(
            r["first_token_s"] is not None and r["first_token_s"] - r["arrival_s"] <= due)
    long_ttft = [ttft(r) for r in records if r["prompt_tokens"] >= LONG]
    return {"policy": label, "n": n, "qps": qps, "wall_s": time.perf_counter() - t0, **s,
            "short_attainment": sum(met["short"]) / len(met["short"]),
            "long_attainment": sum(met["long"]) / len(met["long"]),
            "long_ttft_max": max(long_ttft)}


def ablation_order(r: dict) -> tuple:
    names = [BEFORE, "lars (+ drain only)", "lars (+ due first only)", NO_QUICK, "lars"]
    return r["qps"], names.index(r["policy"])


def goodput_one(policy: str, n: int, seed: int, sat: float) -> dict:
    """``policy``'s goodput on the ``n``-request trace of ``seed``, with the attainments at
    every rate the bisection tried."""
    base = workload(n, 1.0, seed)
    deadlines = GOODPUT.deadlines(base, isolated_ttfts(base, MESH))
    tried: dict[float, dict] = {}

    def ok(qps: float) -> bool:
        att = attainment(run(at_rate(base, qps), policy, MESH), deadlines, GOODPUT)
        tried[qps] = att
        return all(v >= GOODPUT.attainment for v in att.values())

    g = bisect_goodput(ok, 0.5 * sat, sat, rel_tol=GOODPUT_TOL)
    return {"policy": policy, "goodput": g, "at_goodput": tried.get(g),
            "tried": sorted(tried.items())}


def work(task: tuple) -> tuple[str, dict]:
    kind, *args = task
    return kind, goodput_one(*args) if kind == "goodput" else run_one(tuple(args))


def pool_map(tasks: list[tuple], jobs: int, desc: str) -> list[tuple[str, dict]]:
    with multiprocessing.Pool(jobs) as pool:
        return list(tqdm(pool.imap_unordered(work, tasks, chunksize=1), total=len(tasks),
                         desc=desc))


def spp_scaling(out_dir: Path) -> list[str]:
    """1M-token isolated prefill (Llama-3 70B, H100, TP8) against SPP degree."""
    rows, base = [], None
    for spp in (1, 2, 4, 8):
        model = GpuTimeModel("llama3-70b", "h100", tp=8, spp=spp)
        # Chunks sized to a 4 s stage budget (long chunks: SPP's prefill-throughput regime).
        t = PrefillTimeCache(StageTimes(model), 1 << 20, 4.0, max_chunk=32_768).time(1 << 20)
        base = base or t
        rows.append((spp, 8 * spp, t, base / t, base / t / spp))
    plt.figure(figsize=(4.5, 3.2))
    plt.plot([r[0] for r in rows], [r[3] for r in rows], "o-", label="simulated")
    plt.plot([1, 8], [1, 8], "k--", lw=0.8, label="linear")
    plt.xlabel("SPP degree (TP8 each)")
    plt.ylabel("1M-token prefill speed-up")
    plt.legend()
    plt.tight_layout()
    plt.savefig(out_dir / "spp_scaling.png", dpi=120)
    plt.close()
    return ["| SPP | GPUs | 1M prefill (s) | speed-up | efficiency |", "|---:|---:|---:|---:|---:|"
            ] + [f"| {a} | {b} | {c:.1f} | {d:.2f}x | {e:.0%} |" for a, b, c, d, e in rows]


def kvp_tpot(out_dir: Path) -> list[str]:
    """Decode iteration (TPOT) of one 2M-token request beside 32 short decodes, against KVP."""
    rows = []
    for kvp in (1, 2, 4):
        model = GpuTimeModel("llama3-70b", "h100", tp=8, spp=1, kvp=kvp)
        for ctx in (1 << 20, 2 << 20):
            plan = BatchPlan((ScheduledChunk("long", ctx, 1, True),) + tuple(
                ScheduledChunk(f"s{i}", 2000, 1, True) for i in range(32)), ())
            rows.append((kvp, ctx, model.predict(plan)))
    plt.figure(figsize=(4.5, 3.2))
    for ctx in (1 << 20, 2 << 20):
        pts = [(k, t) for k, c, t in rows if c == ctx]
        plt.plot(*zip(*pts), "o-", label=f"{ctx >> 20}M context")
    plt.xlabel("KVP degree (TP8 each)")
    plt.ylabel("TPOT (s)")
    plt.legend()
    plt.tight_layout()
    plt.savefig(out_dir / "kvp_tpot.png", dpi=120)
    plt.close()
    one = {c: t for k, c, t in rows if k == 1}
    return ["| KVP | GPUs | context | TPOT (ms) | vs KVP 1 |", "|---:|---:|---:|---:|---:|"] + [
        f"| {k} | {8 * k} | {c >> 20}M | {t * 1e3:.1f} | {one[c] / t:.2f}x |" for k, c, t in rows]


def profile_error() -> list[str]:
    """The time model's per-layer curve fitted on alternate token counts of each Vidur
    ``mlp.csv``, its relative error on the held-out ones (the model's own interpolation)."""
    out = ["| profile | TP | held-out rows | median error | P90 error |",
           "|---|---:|---:|---:|---:|"]
    for path in sorted((profiles_root() / "profiles" / "compute").glob("*/*/mlp.csv")):
        prof = _load_compute(path)
        for tp, ops in sorted(prof.medians_ms.items()):
            sizes = sorted(ops["add"])
            total = {n: sum(statistics.mean(ops[op][n]) for op in LAYER_OPS) for n in sizes}
            fit, held = sizes[::2], sizes[1::2]
            curve = _Curve.from_points({n: [total[n]] for n in fit})
            err = [abs(curve(n) - total[n]) / total[n] for n in held if n < fit[-1]]
            out.append(f"| {path.parent.parent.name}/{path.parent.name} | {tp} | {len(err)} | "
                       f"{np.median(err):.1%} | {np.percentile(err, 90):.1%} |")
    return out


def bars(rows: list[dict], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, (key, label) in zip(axes, (("short_ttft_p50", "short TTFT P50 (s)"),
                                       ("short_ttft_p99", "short TTFT P99 (s)"),
                                       ("short_tpot_p50", "short TPOT P50 (s)"))):
        vals = [r[key] if math.isfinite(r[key]) else np.nan for r in rows]
        ax.bar([r["policy"] for r in rows], vals, color=["C0", "C1", "C2"][:len(rows)])
        ax.set_yscale("log")
        ax.set_title(label)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclasses.dataclass
class Load:
    """The workload's lengths, each policy's saturation QPS (time model), the lowest of the
    three systems' and the shared load (80% of it)."""

    n: int
    seed: int
    lengths: list
    sat: dict[str, float]
    lowest: float
    qps: float


def load(n: int, seed: int) -> Load:
    lengths = workload(n, 1.0, seed)
    sat = {p: saturation(lengths, p, MESH) for p in POLICIES}
    lowest = min(sat[p] for p in SYSTEMS)
    return Load(n, seed, lengths, sat, lowest, round(0.8 * lowest, 3))


def ablation_tasks(ld: Load) -> list[tuple]:
    return [("run", v, ld.n, ld.qps, ld.seed) for v in VARIANTS]


def attainment_rows(ld: Load, jobs: int) -> list[dict]:
    """lars with each ordering rule off, and lars, at the shared load (in table order)."""
    rows = [r for _, r in pool_map(ablation_tasks(ld) + [("run", "lars", ld.n, ld.qps,
                                                           ld.seed)], jobs, "attainment")]
    return sorted(rows, key=ablation_order)


@dataclasses.dataclass
class Runs:
    """Every run's result: goodput per policy, the runs at fixed loads, each policy at 80% of
    its own saturation, lars and loongserve at loongserve's goodput, the three systems' rows
    (labelled) and the runs' wall time."""

    good: dict[str, dict]
    runs: list[dict]
    own: list[dict]
    at_loong: dict[str, dict]
    rows: list[dict]
    wall: float


def run_all(ld: Load, jobs: int, figs: Path) -> Runs:
    """Every run of the page, in ``jobs`` processes; the headline plots into ``figs``."""
    n, seed, sat, qps = ld.n, ld.seed, ld.sat, ld.qps
    t0 = time.perf_counter()
    tasks = [("goodput", p, n, seed, sat[p]) for p in POLICIES]
    tasks += [("run", p, n, round(0.8 * sat[p], 3), seed) for p in POLICIES]
    tasks += [("run", p, n, q, seed) for q in (qps, PAPER_QPS) for p in SYSTEMS]
    tasks += ablation_tasks(ld)
    done = pool_map(list(dict.fromkeys(tasks)), jobs, "runs")  # each (policy, load) once
    good = {r["policy"]: r for kind, r in done if kind == "goodput"}
    runs = [r for kind, r in done if kind == "run"]
    own = [r for r in runs if r["policy"] in POLICIES and r["qps"] == round(
        0.8 * sat[r["policy"]], 3)]
    loong_g = good["loongserve"]["goodput"]
    at_loong = {r["policy"]: r for _, r in pool_map(
        [("run", p, n, loong_g, seed) for p in ("lars", "loongserve")], jobs,
        "at loongserve's goodput")}
    wall = time.perf_counter() - t0
    rows = sorted((r for r in runs if r["policy"] in SYSTEMS and r["qps"] in (qps, PAPER_QPS)),
                  key=lambda r: (r["qps"] != qps, SYSTEMS.index(r["policy"])))
    for r in rows:
        r["label"] = (f"{r['qps']} QPS (80% of the lowest saturation)" if r["qps"] == qps else
                      f"{r['qps']} QPS ({'above' if r['qps'] > ld.lowest else 'below'}"
                      f" the lowest saturation; the paper's load)")
    head = [r for r in rows if r["qps"] == qps]
    bars(head, figs / "headline.png", f"{n} requests at {qps} QPS (80% of saturation)")
    bars([r for r in rows if r["qps"] == PAPER_QPS], figs / "paper_load.png",
         f"{n} requests at {PAPER_QPS} QPS")
    return Runs(good, runs, own, at_loong, rows, wall)


def short_floors(ld: Load) -> tuple[float, float]:
    """The short requests' isolated TTFT P50 and P90 on lars's mesh."""
    short = [t for t in ld.lengths if t.prompt_tokens < LONG]
    alone = isolated_ttfts(short, MESH)
    return np.percentile(alone, 50), np.percentile(alone, 90)

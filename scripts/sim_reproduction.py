"""Paper-scale reproduction on the simulator: Llama-3 8B on 16 A100s (TP8 x SPP2), ShareGPT4
short requests plus 5% Medha-SWE-like long ones (128K-1M tokens), Poisson load swept over QPS,
every policy. Writes a CSV, a PNG (short-request TTFT P50/P90 against QPS) and markdown tables.

    python scripts/sim_reproduction.py                       # the full sweep (docs/sim/)
    python scripts/sim_reproduction.py --qps 0.75 --requests 200 --out-dir /tmp/sim

The long requests are synthetic: Medha-SWE is not public, only its prompt P50 393K / P90 839K
and output P50 518 / P90 808 tokens; a log-normal fitted to each pair, prompts clipped to
[128Ki, 1Mi]. Each QPS point replays the same requests (the same seed draws the same unit-rate
Poisson process, scaled by 1 / QPS) until ``--drain`` seconds after the last arrival; what has
not happened by then counts as never (TTFT inf, long request not completed).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import multiprocessing
import time
from pathlib import Path

from harness.plots import qps_sweep
from harness.workload import WorkloadSpec, build_workload
from jserve.bench.metrics import summarize
from jserve.scheduler.registry import SIMULATED_POLICIES as POLICIES
from jserve.serving.commands import add_budget_arg
from jserve.sim.policies import SimConfig, run
from jserve.sim.trace import TraceRequest, read_trace, write_trace

QPS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75)
COLUMNS = ("policy", "qps", "requests", "short", "long", "short_ttft_p50", "short_ttft_p90",
           "short_tpot_p50", "short_tpot_p90", "long_ttft_p50", "long_ttft_p90",
           "long_completed", "window_s", "wall_s")
_COUNTS = ("requests", "short", "long", "long_completed")
MESH = SimConfig(model="llama3-8b", hardware="a100", tp=8, spp=2)


def write_workload(path: Path, n: int, seed: int) -> None:
    """The request lengths (no arrivals): ShareGPT4 shorts with 5% long requests mixed in."""
    write_trace(path, build_workload(WorkloadSpec(num_requests=n, long_fraction=0.05, seed=seed)),
                arrivals=False)


def horizon(trace: list[TraceRequest], drain_s: float) -> float:
    return round(max(t.arrival_s for t in trace) + drain_s, 3)


def run_point(args: tuple[str, float, str, int, float, float]) -> dict:
    policy, qps, workload, seed, drain_s, budget = args
    trace = read_trace(workload, qps=qps, seed=seed)
    cfg = dataclasses.replace(MESH, iteration_budget=budget, horizon_s=horizon(trace, drain_s))
    t0 = time.perf_counter()
    s = summarize(run(trace, policy, cfg))
    return {**{k: s[k] for k in COLUMNS if k in s}, "policy": policy, "qps": qps,
            "window_s": cfg.horizon_s, "wall_s": round(time.perf_counter() - t0, 1)}


def fmt(x: float) -> str:
    return "never" if math.isinf(x) else ("-" if math.isnan(x) else f"{x:.2f}")


def markdown(rows: list[dict], qps_list: list[float], focus: float) -> str:
    by = {(r["policy"], r["qps"]): r for r in rows}
    policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    out = [f"At {focus} QPS (seconds; long TTFT over requests that got a first token):", "",
           "| policy | short TTFT P50 | P90 | short TPOT P50 | P90 | long TTFT P50 | P90 "
           "| long completed |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in policies:
        r = by.get((p, focus))
        if r:
            out.append(f"| {p} | " + " | ".join(fmt(r[k]) for k in (
                "short_ttft_p50", "short_ttft_p90", "short_tpot_p50", "short_tpot_p90",
                "long_ttft_p50", "long_ttft_p90")) + f" | {r['long_completed']}/{r['long']} |")
    for key, title in (("short_ttft_p50", "Short-request TTFT P50 (s) against QPS"),
                       ("short_ttft_p90", "Short-request TTFT P90 (s) against QPS"),
                       ("long_completed", "Long requests completed in the window")):
        out += ["", f"{title}:", "", "| policy | " + " | ".join(map(str, qps_list)) + " |",
                "|---|" + "---:|" * len(qps_list)]
        for p in policies:
            cells = [by.get((p, q)) for q in qps_list]
            out.append(f"| {p} | " + " | ".join(
                "" if c is None else (f"{c[key]}/{c['long']}" if key == "long_completed"
                                      else fmt(c[key])) for c in cells) + " |")
    return "\n".join(out) + "\n"


def sweep(a: argparse.Namespace) -> list[dict]:
    workload = a.out_dir / "workload.csv"
    write_workload(workload, a.requests, a.seed)
    # Costliest first (deadline policies at high load) so the pool's tail is short.
    tasks = sorted(((p, q, str(workload), a.seed, a.drain, a.iteration_budget)
                    for p in a.policies for q in a.qps),
                   key=lambda t: (t[0] in ("fcfs", "sarathi", "loongserve"), -t[1]))
    rows = []
    with multiprocessing.Pool(a.jobs) as pool:
        for r in pool.imap_unordered(run_point, tasks):
            rows.append(r)
            print(f"{r['policy']:>10} qps={r['qps']:<5} short TTFT P50 "
                  f"{fmt(r['short_ttft_p50'])} P90 {fmt(r['short_ttft_p90'])}  long "
                  f"{r['long_completed']}/{r['long']}  ({r['wall_s']} s)", flush=True)
    return rows


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v if k == "policy" else (int(v) if k in _COUNTS else float(v))
                 for k, v in r.items()} for r in csv.DictReader(f)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--qps", type=float, nargs="+", default=list(QPS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drain", type=float, default=600.0,
                    help="seconds the clock runs on after the last arrival")
    add_budget_arg(ap, MESH.iteration_budget)
    ap.add_argument("--focus-qps", type=float, default=0.75)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out-dir", type=Path, default=Path("docs/sim"))
    ap.add_argument("--replot", action="store_true",
                    help="redraw the PNG and tables from OUT_DIR/reproduction.csv, no runs")
    a = ap.parse_args()

    a.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.replot:
        rows = read_rows(a.out_dir / "reproduction.csv")
        a.qps = sorted({r["qps"] for r in rows})
    else:
        rows = sweep(a)
    wall = time.perf_counter() - t0
    rows.sort(key=lambda r: (POLICIES.index(r["policy"]), r["qps"]))
    if not a.replot:
        with open(a.out_dir / "reproduction.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
    qps_sweep(rows, a.out_dir / "ttft_vs_qps.png", dashed=("lars-ss",),
              title="Llama-3 8B, 16 A100 (TP8 x SPP2), ShareGPT4 + 5% synthetic Medha-SWE long")
    table = markdown(rows, sorted(a.qps), a.focus_qps)
    (a.out_dir / "reproduction.md").write_text(table)
    print(table)
    by = {(r["policy"], r["qps"]): r for r in rows}
    for lars in ("lars", "lars-ss"):
        r, base = by.get((lars, a.focus_qps)), by.get(("loongserve", a.focus_qps))
        if r and base:
            print(f"{lars} vs loongserve at {a.focus_qps} QPS: short TTFT P50 "
                  f"{base['short_ttft_p50'] / r['short_ttft_p50']:.0f}x lower, P90 "
                  f"{base['short_ttft_p90'] / r['short_ttft_p90']:.0f}x lower; long completed "
                  f"{r['long_completed']}/{r['long']}")
    if not a.replot:
        print(f"{len(rows)} runs of {a.requests} requests in {wall:.0f} s with {a.jobs} "
              f"processes; wrote {a.out_dir}/reproduction.csv")
    print(f"wrote {a.out_dir}/ttft_vs_qps.png and reproduction.md")


if __name__ == "__main__":
    main()

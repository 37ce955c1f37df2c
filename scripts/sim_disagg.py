"""Prefill/decode disaggregation, simulated: colocated LARS replicas against prefill + decode
pools (every request disaggregated, or chosen per request by deadline) on the same GPUs.

    python scripts/sim_disagg.py [--gpus 8,16,32] [--seeds 0] [--jobs 2]   (4.5 minutes)
    python scripts/sim_disagg.py --gpus 8,16,32,64                          (12.5 minutes)
    python scripts/sim_disagg.py --quick                 (32 GPUs, 15 s of arrivals: 1.5 min)

Llama-3 8B on A100 meshes (``harness.disagg_sim.MESHES``: 2 x TP4 for 8 GPUs, TP8 replicas
for 16-64), every replica scheduling with ``lars-ss``, prefix caching on; the trace is the
routing benchmark's (ShareGPT4 chats with shared system prompts, 5% Medha-SWE-like 128K-1M
documents), ``--duration`` seconds of Poisson arrivals at each rate probed. Designs per
cluster size: ``colocated`` (every replica prefills and decodes: ``jserve.sim.disagg`` mode
``never``, identical to the deadline-routed cluster), ``always P:D`` and ``auto P:D`` (P
prefill-only and D decode replicas, ``jserve.routing.disagg.place``), KV moved at
``--gb-per-s`` per GPU. Goodput: the highest QPS at which 90% of short requests meet their
TTFT deadline (max(1.5 x isolated prefill, 0.5 s); as ``scripts/bench_routing.py``), by
geometric bisection to ``--rel-tol``; the clock stops 30 s after the last arrival. Then every
design at the colocated design's goodput. Writes ``--out`` (JSON) and prints both tables.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from harness.disagg_sim import (  # noqa: E402
    MESHES,
    at_rate,
    cell,
    designs,
    markdown,
    markdown_at_rate,
)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gpus", default="8,16,32",
                   help=f"cluster sizes, of {sorted(MESHES)} (64: 8 more minutes)")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds of arrivals a run (requests: rate x this)")
    p.add_argument("--seeds", default="0", help="trace seeds (comma list); figures: medians")
    p.add_argument("--long-fraction", type=float, default=0.05)
    p.add_argument("--gb-per-s", type=float, default=None,
                   help="each GPU's link for the KV transfer (default: "
                   "jserve.sim.disagg.TRANSFER_GB_PER_S, 25)")
    p.add_argument("--lo-per-replica", type=float, default=8.0,
                   help="the goodput search's first bracket, req/s per replica (and twice it)")
    p.add_argument("--max-num-seqs", type=int, default=128,
                   help="sequence slots of every replica (jserve's simulated default)")
    p.add_argument("--rel-tol", type=float, default=0.1, help="goodput resolution (ratio)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--quick", action="store_true",
                   help="32 GPUs only, 15 s of arrivals, 20%% resolution")
    p.add_argument("--out", default=str(ROOT / "docs" / "scale_out" / "sim_disagg.json"))
    a = p.parse_args()
    if a.quick:
        a.gpus, a.duration, a.rel_tol = "32", 15.0, 0.2
    a.gpus = [int(g) for g in a.gpus.split(",")]
    a.seeds = [int(s) for s in a.seeds.split(",")]
    if bad := [g for g in a.gpus if g not in MESHES]:
        p.error(f"--gpus {bad}: choose among {sorted(MESHES)}")
    return a


def _ordered(results: dict) -> dict:
    return {g: {d.name: rows[d.name] for d in designs(MESHES[g][1])}
            for g, rows in sorted(results.items())}


def main() -> None:
    a = parse()
    t0 = time.perf_counter()
    # The largest clusters first, so the pool's tail is short.
    jobs = [(g, d, a) for g in sorted(a.gpus, reverse=True) for d in designs(MESHES[g][1])]
    good: dict = {g: {} for g in a.gpus}
    same: dict = {g: {} for g in a.gpus}
    with multiprocessing.Pool(a.jobs) as pool:
        for gpus, name, row in pool.imap_unordered(cell, jobs):
            good[gpus][name] = row
            print(f"{gpus:>3} GPUs {name:<12} goodput {row['goodput_qps']:.1f} req/s "
                  f"({row['probes']} probes, {time.perf_counter() - t0:.0f} s)", flush=True)
        # then every design at the colocated design's goodput (its documents, its TPOT)
        rate = {g: good[g]["colocated"]["goodput_qps"] for g in a.gpus}
        for gpus, name, row in pool.imap_unordered(
                at_rate, [(g, d, a, rate[g]) for g, d, _ in jobs if rate[g] > 0]):
            same[gpus][name] = row
    good, same = _ordered(good), _ordered({g: r for g, r in same.items() if r})
    wall = time.perf_counter() - t0
    table, table_same = markdown(good), markdown_at_rate(same)
    print(table, "", "At the colocated design's goodput:", table_same, sep="\n")
    out = {"command": " ".join(["python", "scripts/sim_disagg.py", *sys.argv[1:]]),
           "wall_s": round(wall, 1), "uptime": os.popen("uptime").read().strip(),
           "args": {k: v for k, v in vars(a).items() if k != "out"},
           "meshes": {g: {"tp": MESHES[g][0], "replicas": MESHES[g][1]} for g in a.gpus},
           "goodput": {str(g): r for g, r in good.items()},
           "at_colocated_goodput": {str(g): r for g, r in same.items()},
           "table": table, "table_at_colocated_goodput": table_same}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out} in {wall:.0f} s")


if __name__ == "__main__":
    main()

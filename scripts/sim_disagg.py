"""Prefill/decode disaggregation, simulated: colocated LARS replicas against prefill + decode
pools (every request disaggregated, or chosen per request by deadline) on the same GPUs.

    python scripts/sim_disagg.py [--gpus 8,16,32,64] [--seeds 0] [--jobs 2]
    python scripts/sim_disagg.py --quick        (32 GPUs, fewer requests: about a minute)

Llama-3 8B on A100 meshes (``harness.disagg_sim.MESHES``: 2 x TP4 for 8 GPUs, TP8 replicas
for 16-64), every replica scheduling with ``lars-ss``, prefix caching on; the trace is the
routing benchmark's (ShareGPT4 chats with shared system prompts, 5% Medha-SWE-like 128K-1M
documents; ``--duration`` seconds of Poisson arrivals at each rate probed). Designs per
cluster size: ``colocated``
(every replica prefills and decodes: ``jserve.sim.disagg`` mode ``never``, identical to the
deadline-routed cluster), ``always P:D`` and ``auto P:D`` (P prefill-only and D decode
replicas, ``jserve.routing.disagg.place``), KV moved at ``--gb-per-s`` per GPU. Goodput: the
highest QPS at which 90% of short requests meet their TTFT deadline (max(1.5 x isolated
prefill, 0.5 s); as ``scripts/bench_routing.py``), by geometric bisection to ``--rel-tol``;
the clock stops 30 s after the last arrival. Writes ``--out`` (JSON) and prints the table.
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

from harness.disagg_sim import MESHES, cell, designs, markdown  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gpus", default="8,16,32,64", help=f"cluster sizes, of {sorted(MESHES)}")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds of arrivals a run (requests: rate x this)")
    p.add_argument("--seeds", default="0", help="trace seeds (comma list); figures: medians")
    p.add_argument("--long-fraction", type=float, default=0.05)
    p.add_argument("--gb-per-s", type=float, default=None,
                   help="each GPU's link for the KV transfer (default: "
                   "jserve.sim.disagg.TRANSFER_GB_PER_S, 25)")
    p.add_argument("--lo-per-replica", type=float, default=8.0,
                   help="the goodput search's first bracket, req/s per replica (and twice it)")
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


def main() -> None:
    a = parse()
    t0 = time.perf_counter()
    # The largest clusters first, so the pool's tail is short.
    jobs = [(g, d, a) for g in sorted(a.gpus, reverse=True) for d in designs(MESHES[g][1])]
    results: dict = {g: {} for g in sorted(a.gpus)}
    with multiprocessing.Pool(a.jobs) as pool:
        for gpus, name, row in pool.imap_unordered(cell, jobs):
            results[gpus][name] = row
            print(f"{gpus:>3} GPUs {name:<12} goodput {row['goodput_qps']:.1f} req/s "
                  f"({row['probes']} probes, {time.perf_counter() - t0:.0f} s)", flush=True)
    for g in results:  # in the designs' order
        order = [d.name for d in designs(MESHES[g][1])]
        results[g] = {n: results[g][n] for n in order}
    wall = time.perf_counter() - t0
    table = markdown(results)
    print(table)
    out = {"command": " ".join(["python", "scripts/sim_disagg.py", *sys.argv[1:]]),
           "wall_s": round(wall, 1), "uptime": os.popen("uptime").read().strip(),
           "args": {k: v for k, v in vars(a).items() if k != "out"},
           "meshes": {g: {"tp": MESHES[g][0], "replicas": MESHES[g][1]} for g in a.gpus},
           "results": {str(g): r for g, r in results.items()}, "table": table}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out} in {wall:.0f} s")


if __name__ == "__main__":
    main()

"""Offline evaluation of scheduling policies on the live engine: a ShareGPT4 + synthetic
Medha-SWE workload (``harness.workload``) replayed with wall-clock arrivals against each
policy, in process or against a running ``jserve serve``; per-request records, summaries,
TTFT CDF / TPOT / QPS-sweep plots and ratios against a baseline, all under --out-dir.

    python scripts/offline_eval.py --policies fcfs lars --qps 0.5 1 2 --requests 100
    python scripts/offline_eval.py --arrivals azure-conv --time-scale 5 --policies lars
    python scripts/offline_eval.py --target localhost:50051 --policies lars   # a server, gRPC
    python scripts/offline_eval.py --target http://localhost:8000 --policies lars  # OpenAI HTTP

The lengths are scaled for the machine (--short-scale, --long-scale, --output-scale), and the
workload line printed with every result says how.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from harness.evaluate import evaluate, local_runner, ratio_table, remote_runner, write_plots
from harness.workload import WorkloadSpec
from jserve.bench.metrics import Slo
from jserve.engine.config import EngineConfig
from jserve.flags.args import add_engine_args, llm_kwargs
from jserve.scheduler import POLICIES


def add_workload_args(ap: argparse.ArgumentParser, d: WorkloadSpec) -> None:
    ap.add_argument("--requests", type=int, default=d.num_requests)
    ap.add_argument("--long-fraction", type=float, default=d.long_fraction)
    ap.add_argument("--qps", type=float, nargs="+", default=[d.qps],
                    help="Poisson arrival rate; several values sweep the load")
    ap.add_argument("--arrivals", default=None,
                    help="replay arrival times instead: azure-conv or a trace with arrived_at")
    ap.add_argument("--lengths", default=d.short_trace,
                    help="short requests' lengths: sharegpt4, azure-conv or a CSV/JSONL trace")
    ap.add_argument("--time-scale", type=float, default=d.time_scale,
                    help="replayed arrival times are multiplied by this")
    ap.add_argument("--short-scale", type=float, default=d.short_scale)
    ap.add_argument("--long-scale", type=float, default=d.long_scale)
    ap.add_argument("--output-scale", type=float, default=d.output_scale)
    ap.add_argument("--min-tokens", type=int, default=d.min_tokens)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--ttft-slo", type=float, default=Slo().ttft_s,
                    help="TTFT SLO floor (s) for goodput and deadline misses")
    ap.add_argument("--ttft-slo-per-token", type=float, default=Slo().ttft_per_token_s,
                    help="TTFT SLO seconds per prompt token (long prompts get more time)")
    ap.add_argument("--tpot-slo", type=float, default=Slo().tpot_s)
    ap.add_argument("--window", type=float, default=None,
                    help="stop each run this many seconds after it starts")


def workload_from_args(a: argparse.Namespace) -> WorkloadSpec:
    replay = a.arrivals is not None
    return WorkloadSpec(
        num_requests=a.requests, long_fraction=a.long_fraction,
        qps=None if replay else a.qps[0],
        arrival_trace=a.arrivals, short_trace=a.lengths,
        time_scale=a.time_scale, short_scale=a.short_scale, long_scale=a.long_scale,
        output_scale=a.output_scale, min_tokens=a.min_tokens, seed=a.seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["fcfs", "sarathi", "edf", "lars"],
                    choices=POLICIES)
    ap.add_argument("--baseline", default="fcfs")
    ap.add_argument("--target", "--server", dest="server", default=None,
                    help="a running server: host:port (jserve gRPC) or http://host:port (any "
                         "OpenAI-compatible server, jserve's included); --policies are labels")
    ap.add_argument("--auth-token", default=None, help="bearer token for --target")
    # The engine's flags (as ``jserve serve``'s), with this evaluation's defaults.
    add_engine_args(ap, warmup=EngineConfig.warmup, max_num_seqs=32,
                    max_num_batched_tokens=256, kv_cache_bytes=2 << 30)
    ap.add_argument("--iteration-budget", "--engine-tpot-slo", type=float, default=0.05,
                    help="the deadline-aware policies' iteration budget (s; "
                         "--engine-tpot-slo: its name before)")
    ap.add_argument("--out-dir", type=Path, default=Path("bench-out"))
    ap.add_argument("--no-progress", action="store_true")
    add_workload_args(ap, WorkloadSpec())
    a = ap.parse_args()
    spec = workload_from_args(a)
    if a.server:
        run = remote_runner(a.server, window_s=a.window, seed=a.seed, progress=not a.no_progress,
                            auth_token=a.auth_token)
    else:
        run = local_runner(a.model, window_s=a.window, seed=a.seed, progress=not a.no_progress,
                           iteration_budget=a.iteration_budget, **llm_kwargs(a))
    sweep = a.qps if len(a.qps) > 1 and a.arrivals is None else None
    results = evaluate(spec, a.policies, run, out_dir=a.out_dir, qps_points=sweep,
                       slo=Slo(a.ttft_slo, a.ttft_slo_per_token, a.tpot_slo))
    paths = write_plots(results, a.out_dir, title=spec.describe(),
                        long_prompt_tokens=spec.long_prompt_tokens)
    print(ratio_table(results, a.baseline))
    print("wrote", ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()

"""The convoy-effect benchmark on the live engine: one trace of short chats with a few long
documents mixed in, run against fcfs (non-preemptive, the convoy baseline), sarathi, edf and
lars on the built-in default model, with the ratios against fcfs and the pass/fail lines of
the claims in docs/convoy.md.

    python scripts/convoy_benchmark.py                  # the CPU configuration (~20 min)
    python scripts/convoy_benchmark.py --smoke          # seconds; what CI runs
    python scripts/convoy_benchmark.py --target http://localhost:8000   # through a server
    python scripts/convoy_benchmark.py --seeds 0 1 2 --loads 1 2 --requests 30 \
        --long-scale 1/48 --policies fcfs sarathi lars   # the sweep (docs/convoy.md, ~10 min)

CPU scale: ShareGPT4 short prompts x1/4 (64-2K tokens), synthetic Medha-SWE long prompts
x1/32 (4K-32K tokens), outputs x1/4, 5% long, Poisson arrivals. The workload line printed
with the results gives the exact figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import fractions
import sys
from pathlib import Path

from harness.convoy import (
    CPU,
    CPU_ENGINE,
    POLICIES,
    SMOKE,
    SMOKE_ENGINE,
    run_policies,
    run_remote,
    run_sweep,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run (CI)")
    ap.add_argument("--qps", type=float, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--long-scale", type=fractions.Fraction, default=None,
                    help="scale of the long prompts, e.g. 1/48 (default 1/32)")
    ap.add_argument("--out-dir", type=Path, default=Path("bench-out/convoy"))
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--target", default=None,
                    help="run the workload through a running server instead (http://host:port "
                         "for the OpenAI API, or a jserve gRPC host:port); it runs its own "
                         "policy, so the cross-policy checks are skipped")
    ap.add_argument("--auth-token", default=None, help="bearer token for --target")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="sweep: these workload seeds (with --loads; one engine per policy)")
    ap.add_argument("--loads", type=float, nargs="+", default=None,
                    help="sweep: these arrival rates (QPS)")
    ap.add_argument("--policies", nargs="+", default=None, choices=POLICIES,
                    help=f"policies to run (default {' '.join(POLICIES)})")
    a = ap.parse_args(argv)
    spec, engine = (SMOKE, SMOKE_ENGINE) if a.smoke else (CPU, CPU_ENGINE)
    spec = dataclasses.replace(spec, **{k: v for k, v in (
        ("qps", a.qps), ("num_requests", a.requests), ("seed", a.seed),
        ("long_scale", None if a.long_scale is None else float(a.long_scale)))
        if v is not None})
    policies = list(a.policies or POLICIES)
    if a.seeds or a.loads:
        if a.target:
            ap.error("--seeds/--loads run the engine in process; not with --target")
        if "lars" not in policies or len(policies) < 2:
            ap.error("the sweep compares lars with at least one other policy")
        return run_sweep(spec, engine, a.seeds or [spec.seed], a.loads or [spec.qps], policies,
                         a.out_dir, progress=not a.no_progress, profile=not a.smoke)
    if a.target:
        return run_remote(spec, a.target, a.out_dir, not a.no_progress, a.auth_token)
    return run_policies(spec, engine, policies, a.out_dir, not a.no_progress, a.smoke)


if __name__ == "__main__":
    sys.exit(main())

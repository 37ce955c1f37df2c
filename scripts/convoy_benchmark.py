"""The convoy-effect benchmark on the live engine: one trace of short chats with a few long
documents mixed in, run against fcfs (non-preemptive, the convoy baseline), sarathi, edf and
lars on the built-in default model, with the ratios against fcfs and the pass/fail lines of
the claims in docs/convoy.md.

    python scripts/convoy_benchmark.py                  # the CPU configuration (~20 min)
    python scripts/convoy_benchmark.py --smoke          # seconds; what CI runs
    python scripts/convoy_benchmark.py --target http://localhost:8000   # through a server

CPU scale: ShareGPT4 short prompts x1/4 (64-2K tokens), synthetic Medha-SWE long prompts
x1/32 (4K-32K tokens), outputs x1/4, 5% long, Poisson arrivals. The workload line printed
with the results gives the exact figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from jserve.bench.evaluate import (
    ensure_predictor,
    evaluate,
    local_runner,
    ratio_table,
    remote_runner,
    write_plots,
)
from jserve.bench.metrics import Slo, ratio
from jserve.bench.workload import WorkloadSpec, build_workload, model_len_for

POLICIES = ("fcfs", "sarathi", "edf", "lars")
CPU = WorkloadSpec(num_requests=200, long_fraction=0.05, qps=2.0, short_scale=1 / 4,
                   long_scale=1 / 32, output_scale=1 / 4, min_tokens=64, seed=0)
CPU_ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=256, kv_cache_bytes=2 << 30,
                  tpot_slo=0.05)
# Seconds on any machine: tiny lengths and the test suite's engine shapes (compiled once).
SMOKE = WorkloadSpec(num_requests=8, long_fraction=0.25, qps=8.0, short_scale=1 / 512,
                     long_scale=1 / 4096, output_scale=1 / 64, min_tokens=4, seed=0)
SMOKE_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2,
                    max_model_len=512, warmup=False)


def checks(results) -> list[tuple[str, bool]]:
    """The claims: lars vs fcfs short TTFT P50 >= 10x and P90 >= 30x lower, lars short TPOT
    P90 no worse than sarathi's, every long request completed under lars."""
    s = {r.policy: r.summary for r in results}
    lars, fcfs, sarathi = s["lars"], s["fcfs"], s["sarathi"]
    p50 = ratio(fcfs["short_ttft_p50"], lars["short_ttft_p50"])
    p90 = ratio(fcfs["short_ttft_p90"], lars["short_ttft_p90"])
    return [
        (f"lars short TTFT P50 {p50:.1f}x lower than fcfs (>= 10x)", p50 >= 10),
        (f"lars short TTFT P90 {p90:.1f}x lower than fcfs (>= 30x)", p90 >= 30),
        (f"lars short TPOT P90 {lars['short_tpot_p90'] * 1e3:.1f} ms <= sarathi "
         f"{sarathi['short_tpot_p90'] * 1e3:.1f} ms",
         not lars["short_tpot_p90"] > sarathi["short_tpot_p90"]),
        (f"lars completed {lars['long_completed']}/{lars['long']} long requests",
         lars["long_completed"] == lars["long"]),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run (CI)")
    ap.add_argument("--qps", type=float, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out-dir", type=Path, default=Path("bench-out/convoy"))
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--target", default=None,
                    help="run the workload through a running server instead (http://host:port "
                         "for the OpenAI API, or a jserve gRPC host:port); it runs its own "
                         "policy, so the cross-policy checks are skipped")
    ap.add_argument("--auth-token", default=None, help="bearer token for --target")
    a = ap.parse_args(argv)
    spec, engine = (SMOKE, SMOKE_ENGINE) if a.smoke else (CPU, CPU_ENGINE)
    spec = dataclasses.replace(spec, **{k: v for k, v in (
        ("qps", a.qps), ("num_requests", a.requests), ("seed", a.seed)) if v is not None})
    if a.target:
        run = remote_runner(a.target, seed=spec.seed, progress=not a.no_progress,
                            auth_token=a.auth_token)
        results = evaluate(spec, ["server"], run, out_dir=a.out_dir,
                           slo=Slo(ttft_s=0.5, ttft_per_token_s=2e-3, tpot_s=0.2))
        print(ratio_table(results, "server"))
        print(f"wrote {a.out_dir}/ (one policy: the server's; the checks need all four)")
        return 0
    if not a.smoke:  # the smoke run checks plumbing only; it leaves the saved predictor be
        max_len = model_len_for(build_workload(spec))
        ensure_predictor("default", max_context=max_len,
                         **{k: v for k, v in engine.items() if k != "tpot_slo"})
    run = local_runner("default", seed=spec.seed, progress=not a.no_progress, **engine)
    # TTFT SLO: 0.5 s, or 2 ms a prompt token for long prompts; TPOT SLO 0.2 s (CPU figures).
    results = evaluate(spec, POLICIES, run, out_dir=a.out_dir,
                       slo=Slo(ttft_s=0.5, ttft_per_token_s=2e-3, tpot_s=0.2))
    write_plots(results, a.out_dir, title=spec.describe(),
                long_prompt_tokens=spec.long_prompt_tokens)
    print(ratio_table(results, "fcfs"))
    ok = True
    for line, passed in checks(results):
        print(("PASS " if passed else "FAIL ") + line)
        ok &= passed
    print(f"wrote {a.out_dir}/ (records-*.jsonl, summary.json, ttft_cdf.png, tpot.png)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

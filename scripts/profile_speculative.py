"""Where a batch-1 speculating step's milliseconds go, against a plain decode step.

    python scripts/profile_speculative.py [--reps 5] [--k 4] [--workload quote]

One greedy request of ``bench_speculative.py``'s workload runs through three engines (same
settings as the bench): ``base`` (no speculation, async), ``base-sync`` (no speculation,
async off) and ``ngram`` (prompt lookup, k drafts). Each phase of ``LLMEngine.step`` is timed
by wrapping the engine's own calls: the proposer, the rest of ``schedule()`` (the policy and
packing), building the step's arrays, dispatching the step, waiting for its tokens (the
readback: this is where the host sits idle while the device runs), and ``update`` plus output
processing. Per step, each phase's median over the run, then the median over ``--reps``
runs. Also the device-only time of a step with 1 decode row and with 1 + k rows of one
sequence (the captured buffers run back to back, 30 calls, median): what the extra rows cost.
"""
from __future__ import annotations

import argparse
import os

from harness.machine import uptime
from harness.spec_decode import WORKLOADS
from harness.spec_profile import profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--workload", default="quote", choices=WORKLOADS)
    a = ap.parse_args()
    print("load before:", uptime(), f"({os.cpu_count()} CPUs)")
    profile(a)
    print("load after:", uptime())


if __name__ == "__main__":
    main()

"""Where the compiled decode step spends its time, op by op (XLA:CPU).

    python scripts/profile_ops.py [--model bench | bench-32k | NAME | DIR] [--batch 32]
                                  [--steps 20] [--top 25]

Builds the engine of ``profile_step.py`` (the bench model), captures one all-decode step at
``--batch`` rows, then traces ``--steps`` calls of the step executable and, separately, of
the sampling executable with ``jax.profiler`` (XLA:CPU records every thunk it runs). Each
traced op is joined with the optimized HLO of its executable and put in a group: a matmul
(named by its weight), the attention loop (a ``while``; its inner ops are broken down
below it), the KV write, layout ops (copies, transposes, pads, slices), and elementwise
fusions (norms, RoPE, SiLU, residual adds). Times are per step, summed over the threads
that ran them (XLA:CPU runs independent thunks side by side, so the sum can exceed the wall
time, which is printed beside it).
"""
from __future__ import annotations

import argparse

from harness.machine import uptime
from harness.op_profile import profile_ops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="bench",
                    help="as profile_step.py's: bench, bench-32k, a built-in name or a "
                         "checkpoint directory")
    ap.add_argument("--batch", type=int, default=32, help="decode rows of the profiled step")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, default=40, help="greedy tokens per request")
    ap.add_argument("--steps", type=int, default=20, help="traced calls of each executable")
    ap.add_argument("--top", type=int, default=25, help="single ops listed")
    ap.add_argument("--hlo-out", default=None, help="write the step's optimized HLO here")
    a = ap.parse_args()
    print(f"load at start: {uptime()}")
    profile_ops(a)
    print(f"load at end: {uptime()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

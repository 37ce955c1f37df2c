"""Evaluate TRAIL on a model with a trained length probe and write docs/trail.md:

1. the probe's mean absolute error per layer on held-out requests (from the training run's
   sidecar JSON), and the shipped probe on fresh test requests, live in the engine: smoothed
   (refined) predictions against prompt-only ones (first prediction minus tokens generated);
2. mean latency and mean TTFT of sprpt (c = 0.5, 0.8, 1) against fcfs (and sarathi, the
   arrival-order policy whose chunking sprpt shares), on a burst (every
   request at t = 0) and on Poisson arrivals at high load (above sarathi's burst
   throughput), wall clock on this machine, greedy decoding to EOS.

    python scripts/train_length_probe.py    # first: trains and ships the probe + sidecar
    python scripts/eval_length_probe.py     # then this (tiny-tasks, CPU: a few minutes)
"""
from __future__ import annotations

import argparse
import sys

from harness.trail import run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-tasks")
    ap.add_argument("--probe", default=None, help="default: the model's shipped probe")
    ap.add_argument("--test-requests", type=int, default=200)
    ap.add_argument("--test-seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64, help="requests per latency workload")
    ap.add_argument("--load", type=float, default=1.2,
                    help="Poisson rate as a multiple of sarathi's burst throughput (the "
                         "engine's capacity without reordering)")
    ap.add_argument("--qps", type=float, default=None, help="Poisson rate (overrides --load)")
    ap.add_argument("--max-tokens", type=int, default=500)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default="docs/trail.md")
    args = ap.parse_args(argv)
    command = "python scripts/eval_length_probe.py " + " ".join(argv if argv is not None
                                                                 else sys.argv[1:])
    run(args, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())

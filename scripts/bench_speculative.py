"""Speculative decoding against plain decoding, side by side in one run: TPOT and mean
accepted length at batch 1 and 8 on four workloads.

    python scripts/bench_speculative.py [--reps 3] [--batches 1 8] [--k 4]

Workloads (one engine per model and mode, all buckets compiled before timing):
  quote      tiny-tasks "list N fruits" (N = 16...), greedy: the answer repeats its own
             earlier lines, the fruit names every eight lines, while the numbers count
             down. The stand-in for document QA that quotes: no model here copies a
             document (docs/notes/speculative.md says what was tried)
  countdown  tiny-tasks "count down from N" (N = 60...), greedy: the tens digit repeats, the
             units do not, so prompt lookup drafts little; also run with a draft model
             (``--draft-model``, default tiny-tasks itself: every draft is right, so this is
             the best any draft model can do at its cost per draft token)
  free       the random default model's free text sampled at temperature 1 (seeded),
             ignore_eos: drafts are rarely accepted and requests stop speculating (greedy,
             this model falls into loops that prompt lookup drafts well)
  loop       (the ceiling) the random default model's greedy text, which falls into a
             short loop within a few tokens: prompt lookup drafts nearly every token, so
             this shows what speculation gives on this machine when drafts are accepted,
             whatever the workload
Modes: ``base`` (no speculation, async scheduling on), ``ngram`` (prompt lookup, k drafts,
n from 1 to 4; plans that carry speculating requests are read back before the next is
planned), ``ngram-sync`` (the same with async scheduling off: what the overlap still buys),
``draft`` (countdown only: the draft model proposes k tokens).
Per run: the median over requests of (last token time - first token time) / (tokens - 1);
per cell: the median over ``--reps`` repetitions, the modes alternating within each
repetition. Prints a markdown table and the machine load (``uptime``) before and after.
"""
from __future__ import annotations

import argparse
import os

from harness.machine import uptime
from harness.spec_decode import WORKLOADS, bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--draft-model", default="tiny-tasks",
                    help="the countdown's draft model ('' : no draft mode)")
    a = ap.parse_args()
    print("load before:", uptime(), f"({os.cpu_count()} CPUs)")
    bench(a)
    print()
    print("load after:", uptime())


if __name__ == "__main__":
    main()

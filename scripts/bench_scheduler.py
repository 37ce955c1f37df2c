"""The scheduler's schedule() ("FormNextBatch") time with 1,000 waiting and 128 running requests.

    python scripts/bench_scheduler.py                      # table: every policy x predictor
    python scripts/bench_scheduler.py --reps 100 --json out.json
    python scripts/bench_scheduler.py --warm               # state read once before timing
    python scripts/bench_scheduler.py --profile lars --predictor gpu   # cProfile one case
    python scripts/bench_scheduler.py --against ../old     # A/B: this tree and a checkout

The state (seeded, rebuilt identically for every policy and predictor):
- running: 120 decodes (ShareGPT4 prompt + part of its output, so KV lengths vary) and 8
  partial prefills, two of them long (64k and 128k prompts past the 32k long threshold);
- waiting: 1,000 requests with ShareGPT4 prompt lengths (the packaged ``sharegpt4`` trace)
  plus 5 long ones (32k-128k tokens), arrived over the last 3 s, with the default TTFT
  deadlines, so some slacks are already negative;
- limits: max_num_seqs 256 (room for 128 admissions), 8192 tokens, 8 prefills per batch,
  a 50 ms iteration budget, space sharing on; KV memory is not the constraint.

Policies: the deadline-aware ones (``DeadlineScheduler``: lars, edf, lrs, fcfs) under each
predictor; ``sarathi`` and ``sprpt`` (which use none; sprpt's running decodes carry predicted
remaining lengths, as the length probe leaves them) once. Predictors: ``gpu`` is the
simulator's ``GpuTimeModel("llama3-8b", "a100", tp=8, spp=2)``; ``linear`` a
``LinearPredictor`` fitted to it on random plans. Each repetition restores the state (a deep
copy; predictor and prefill-time cache shared) and times ``schedule()`` alone. A fresh copy
is cold in the CPU caches; ``--warm`` reads every request once before timing, as the previous
step would have left them.

``--against DIR`` times the ``jserve`` package of another checkout (say a ``git worktree`` of
an older commit) with this script's state, alternating with this tree's over ``--rounds``
runs, and prints both with their ratio: on a shared, noisy machine the ratio within one run
is the figure to trust.
"""
from __future__ import annotations

from harness.schedule_time import build_parser, run


def main() -> None:
    run(build_parser().parse_args())


if __name__ == "__main__":
    main()

"""A mixed serving trace against the step programs: programs compiled at start and
during the trace, steps padded up to a larger compiled shape, token slots filled, trace time,
and start-up with an empty and a warm persistent cache (docs/startup.md).

    python scripts/bench_program_set.py                        # this checkout, defaults
    python scripts/bench_program_set.py --before /tmp/before   # and another tree first
    python scripts/bench_program_set.py --engine-kwargs '{"warmup": "all"}' --label all

The trace (``harness.mixed_trace.mixed_trace``): 120 requests, prompts 1-6,000 tokens
log-normal (median 200), 1-200 output tokens, in 4 waves 3 s apart, greedy, EOS ignored, on
the built-in ``default`` model with default engine settings. Every start is a fresh process;
"cold" uses a new cache directory, "warm" the same one again. ``--before DIR``: a jserve tree
(e.g. ``git archive`` of an older commit) measured the same way first, by this checkout's
``harness.mixed_trace``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from harness import mixed_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--before", default=None, help="another jserve tree, measured first")
    p.add_argument("--before-kwargs", default=None,
                   help="JSON LLM keywords for the --before tree's runs")
    p.add_argument("--engine-kwargs", default=None, help="JSON LLM keywords (this checkout)")
    p.add_argument("--label", default="after", help="this checkout's label in the table")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--max-prompt", type=int, default=6000)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--wave-gap", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=None, help="the rows as JSON")
    a = p.parse_args()
    trace = ["--requests", str(a.requests), "--max-prompt", str(a.max_prompt),
             "--waves", str(a.waves), "--wave-gap", str(a.wave_gap)]
    caches = tempfile.mkdtemp(prefix="bench-program-set-")
    rows = []
    if a.before:
        rows += mixed_trace.study("before", a.before, trace, a.before_kwargs, caches)
    rows += mixed_trace.study(a.label, None, trace, a.engine_kwargs, caches)
    print(mixed_trace.table(rows))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    shutil.rmtree(caches, ignore_errors=True)


if __name__ == "__main__":
    main()

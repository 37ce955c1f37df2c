"""Structured output's cost on the live CPU engine: JSON-schema requests against the same
requests unconstrained, in one run, at batch 1, 8 and 32.

    python scripts/bench_structured.py [--batches 1 8 32] [--tokens 64] [--reps 3]
                                       [--async-scheduling/--no-async-scheduling]

Each batch runs ``--reps`` times in each mode, alternating (constrained, free, ...), after a
warm-up of both; a run is ``batch`` greedy requests decoding ``--tokens`` tokens each (the
schema below has one free string, long enough that no request finishes before that, and
``ignore_eos`` holds the free ones to the same length). TPOT is the engine's decode time per
generated token per request (mean over requests of (finish - first token) / (tokens - 1));
the table gives the median over reps and the constrained/free ratio. Host time on masks is
timed around every ``Constraint.mask`` call, summed per engine step: P50/P99 over the steps
of the constrained runs, against those steps' own times. Under async scheduling a
constrained request decodes every step like a free one: its row joins the next forward before
its token is read, and its mask goes to the sampler once the host has read that token, while
the forward runs (``jserve.engine.loop.late_masks``); ``--no-async-scheduling`` measures synchronous
steps instead. The machine's load average is printed with the table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jserve import LLM, SamplingParams  # noqa: E402
from jserve.engine.engine import LLMEngine  # noqa: E402
from jserve.sampling import structured  # noqa: E402
from jserve.sampling.structured import StructuredOutput  # noqa: E402

SCHEMA = {"type": "object", "required": ["id", "note"], "additionalProperties": False,
          "properties": {"id": {"type": "integer"}, "note": {"type": "string",
                                                             "minLength": 400}}}


class MaskClock:
    """Host seconds spent in ``Constraint.mask``, per engine step."""

    def __init__(self) -> None:
        self.current = 0.0
        self.steps: list[tuple[float, float]] = []  # (mask seconds, step seconds)
        mask, step = structured.Constraint.mask, LLMEngine.step
        clock = self

        def timed_mask(c):
            t0 = time.perf_counter()
            try:
                return mask(c)
            finally:
                clock.current += time.perf_counter() - t0

        def timed_step(engine):
            clock.current, t0 = 0.0, time.perf_counter()
            out = step(engine)
            clock.steps.append((clock.current, time.perf_counter() - t0))
            return out
        structured.Constraint.mask, LLMEngine.step = timed_mask, timed_step


def run(llm: LLM, batch: int, tokens: int, constrained: bool) -> float:
    so = StructuredOutput(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=not constrained,
                             structured_output=so) for _ in range(batch)]
    outs = llm.generate([f"Record {i}:" for i in range(batch)], params)
    assert all(len(o.token_ids) == tokens for o in outs), "a request finished early"
    return statistics.mean((o.metrics.finished_time - o.metrics.first_token_time)
                           / (len(o.token_ids) - 1) for o in outs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    a = p.parse_args()
    llm = LLM("default", max_num_seqs=max(a.batches), max_num_batched_tokens=256,
              max_model_len=1024, async_scheduling=a.async_scheduling)
    clock = MaskClock()
    rows = []
    load_start = os.getloadavg()[0]
    with tqdm(total=len(a.batches) * (2 * a.reps + 2), desc="runs") as bar:
        for batch in a.batches:
            run(llm, batch, a.tokens, True)
            run(llm, batch, a.tokens, False)
            bar.update(2)
            tpot = {True: [], False: []}
            clock.steps.clear()
            for _ in range(a.reps):
                for constrained in (True, False):
                    before = len(clock.steps)
                    tpot[constrained].append(run(llm, batch, a.tokens, constrained))
                    if not constrained:  # keep only the constrained runs' steps
                        del clock.steps[before:]
                    bar.update(1)
            masks = np.array([m for m, _ in clock.steps]) * 1e3
            steps = np.array([s for _, s in clock.steps]) * 1e3
            rows.append((batch, statistics.median(tpot[True]) * 1e3,
                         statistics.median(tpot[False]) * 1e3, np.percentile(masks, 50),
                         np.percentile(masks, 99), np.percentile(steps, 50)))
    mode = "async" if a.async_scheduling else "sync"
    print(f"\nJSON schema vs free, {a.tokens} tokens a request, median of {a.reps} reps "
          f"({mode} scheduling; load average {load_start:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end):")
    print("| batch | TPOT constrained | TPOT free | ratio | mask ms/step P50 | P99 | "
          "step ms P50 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch, con, free, m50, m99, s50 in rows:
        print(f"| {batch} | {con:.2f} ms | {free:.2f} ms | {con / free:.2f}x | {m50:.3f} | "
              f"{m99:.3f} | {s50:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

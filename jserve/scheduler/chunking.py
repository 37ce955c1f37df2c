"""Adaptive chunking: the largest prefill chunk whose batch still fits a time budget, and the
prefill-time cache built from that chunk sequence (Medha Algorithms 2 and 3)."""
from __future__ import annotations

import bisect
import dataclasses

from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.scheduler.predictor import RuntimePredictor


def with_chunk(plan: BatchPlan, request_id: str, start: int, n: int, samples: bool) -> BatchPlan:
    return dataclasses.replace(
        plan, prefills=plan.prefills + (ScheduledChunk(request_id, start, n, samples),))


def largest_chunk(predictor: RuntimePredictor, plan: BatchPlan, request_id: str, start: int,
                  remaining: int, budget_s: float, *, granularity: int = 32,
                  max_chunk: int | None = None) -> int:
    """Largest n <= min(remaining, max_chunk), a multiple of ``granularity`` unless it is the
    whole remainder, with predict(plan + chunk(n)) <= budget_s; 0 if none fits.

    Binary search: predicted time is non-decreasing in n.
    """
    cap = remaining if max_chunk is None else min(remaining, max_chunk)
    if cap <= 0:
        return 0

    def fits(n: int) -> bool:
        return predictor.predict(with_chunk(plan, request_id, start, n,
                                            start + n == start + remaining)) <= budget_s

    if fits(cap):
        return cap
    lo, hi = 0, (cap - 1) // granularity  # candidates k * granularity, k in [1, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * granularity):
            lo = mid
        else:
            hi = mid - 1
    return lo * granularity


class PrefillTimeCache:
    """Isolated prefill time T(n) of an n-token prompt run alone with adaptive chunks, at
    ``granularity``-token resolution up to ``max_context`` (Medha Algorithm 3). Built once;
    remaining work of a partly prefilled request = T(total) - T(processed)."""

    def __init__(self, predictor: RuntimePredictor, max_context: int, budget_s: float, *,
                 granularity: int = 256, chunk_granularity: int = 32,
                 max_chunk: int | None = None):
        self.granularity = granularity
        self.lengths = [0]
        self.times = [0.0]
        done, elapsed = 0, 0.0
        empty = BatchPlan((), ())
        while done < max_context:
            n = largest_chunk(predictor, empty, "_", done, max_context - done, budget_s,
                              granularity=chunk_granularity, max_chunk=max_chunk)
            if n == 0:  # the budget is below one minimal chunk: take it anyway
                n = min(chunk_granularity, max_context - done)
            step = predictor.predict(with_chunk(empty, "_", done, n, False))
            # Record every granularity boundary this chunk crosses, pro rata within the chunk.
            while self.lengths[-1] + granularity <= done + n:
                mark = self.lengths[-1] + granularity
                self.lengths.append(mark)
                self.times.append(elapsed + step * (mark - done) / n)
            done += n
            elapsed += step
        if self.lengths[-1] != done:
            self.lengths.append(done)
            self.times.append(elapsed)

    def time(self, n: int) -> float:
        """T(n), linear between table points (n beyond the table extrapolates the last slope)."""
        if n <= 0:
            return 0.0
        i = min(bisect.bisect_left(self.lengths, n), len(self.lengths) - 1)
        x0, x1 = self.lengths[i - 1], self.lengths[i]
        y0, y1 = self.times[i - 1], self.times[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def remaining(self, total: int, processed: int) -> float:
        return self.time(total) - self.time(processed)

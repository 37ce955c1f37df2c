"""Adaptive chunking: the largest prefill chunk whose batch still fits a time budget, and the
prefill-time cache built from that chunk sequence (Medha Algorithms 2 and 3).

The search assumes a predictor's time never falls when a chunk gets longer, starts later
(more context to attend to) or samples, and does not depend on whose chunk it is; the
predictors the deadline policies use (``LinearPredictor``, ``jserve.sim.GpuTimeModel``) are
built of terms that never decrease in chunk sizes and positions. That is what lets it bisect,
and lets one ``ChunkSearch`` skip, unprobed, a request whose smallest chunk costs no less than
one that already missed the same or a larger budget.
"""
from __future__ import annotations

import bisect
import functools

from jserve.scheduler.plan import BatchPlan
from jserve.scheduler.predictor import ChunkTimer, RuntimePredictor, chunk_timer


class ChunkSearch:
    """Largest chunks against one plan for one candidate request after another: the plan's
    time is prepared once, and probes that missed a budget are remembered (module docstring)."""

    def __init__(self, predictor: RuntimePredictor, plan: BatchPlan, granularity: int = 32):
        self.predictor, self.plan, self.granularity = predictor, plan, granularity
        self._missed: list[tuple[float, int, int, bool]] = []  # (budget, start, n, samples)

    @functools.cached_property
    def plan_time(self) -> float:
        """The plan's own predicted time (space sharing and packing ask; once a plan)."""
        return self.predictor.predict(self.plan)

    @functools.cached_property
    def time(self) -> ChunkTimer:
        """Prepared on the first probe: a batch may need none (fcfs, nothing left to pack)."""
        return chunk_timer(self.predictor, self.plan)

    def largest(self, request_id: str, start: int, remaining: int, budget_s: float,
                max_chunk: int | None = None) -> int:
        """Largest n <= min(remaining, max_chunk), a multiple of ``granularity`` unless it is
        the whole remainder, whose batch time is <= budget_s; 0 if none fits."""
        cap = remaining if max_chunk is None else min(remaining, max_chunk)
        if cap <= 0:
            return 0
        g, time = self.granularity, self.time
        smallest = min(cap, g)  # the search's smallest candidate: it decides "none fits"
        samples = smallest == remaining
        if self.missed(start, smallest, samples, budget_s):
            return 0
        if time(request_id, start, smallest, samples) > budget_s:
            self._missed.append((budget_s, start, smallest, samples))
            return 0
        if smallest == cap or time(request_id, start, cap, cap == remaining) <= budget_s:
            return cap
        lo, hi = 1, (cap - 1) // g  # k * g fits for k = lo, not for k > hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if time(request_id, start, mid * g, False) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo * g

    def missed(self, start: int, n: int, samples: bool, budget_s: float) -> bool:
        """Whether a chunk so placed is known not to fit: a probe no more costly (no later,
        no longer, sampling no more) already missed a budget no smaller."""
        return any(budget_s <= b and start >= s and n >= m and samples >= smp
                   for b, s, m, smp in self._missed)


def largest_chunk(predictor: RuntimePredictor, plan: BatchPlan, request_id: str, start: int,
                  remaining: int, budget_s: float, *, granularity: int = 32,
                  max_chunk: int | None = None) -> int:
    """Largest n <= min(remaining, max_chunk), a multiple of ``granularity`` unless it is the
    whole remainder, with predict(plan + chunk(n)) <= budget_s; 0 if none fits."""
    return ChunkSearch(predictor, plan, granularity).largest(request_id, start, remaining,
                                                             budget_s, max_chunk)


class _Memo(dict):
    """n -> fn(n), computed on a miss; hits are a C-level dict lookup. Cleared when full."""

    def __init__(self, fn, limit: int = 1 << 16):
        super().__init__()
        self.fn, self.limit = fn, limit

    def __missing__(self, n: int) -> float:
        if len(self) >= self.limit:
            self.clear()
        value = self[n] = self.fn(n)
        return value


class PrefillTimeCache:
    """Isolated prefill time T(n) of an n-token prompt run alone with adaptive chunks, at
    ``granularity``-token resolution up to ``max_context`` (Medha Algorithm 3). Built once;
    remaining work of a partly prefilled request = T(total) - T(processed) + ``drain_s``.

    ``drain_s``: on a pipelined (SPP) mesh T sums the chunks' issue intervals (stage times),
    but the first token comes out only when the last chunk has passed every stage, one
    pipeline latency after its issue: ``drain_s`` is that latency less one issue interval.
    It is owed by every request with prompt left, however much is done, so it is not part of
    T (a difference of two T values would cancel it). 0 without a pipeline."""

    def __init__(self, predictor: RuntimePredictor, max_context: int, budget_s: float, *,
                 granularity: int = 256, chunk_granularity: int = 32,
                 max_chunk: int | None = None, drain_s: float = 0.0):
        if drain_s < 0:
            raise ValueError(f"drain_s must be >= 0, got {drain_s}")
        self.drain_s = drain_s
        self.granularity = granularity
        self.lengths = [0]
        self.times = [0.0]
        done, elapsed = 0, 0.0
        search = ChunkSearch(predictor, BatchPlan((), ()), chunk_granularity)
        while done < max_context:
            n = search.largest("_", done, max_context - done, budget_s, max_chunk)
            if n == 0:  # the budget is below one minimal chunk: take it anyway
                n = min(chunk_granularity, max_context - done)
            step = search.time("_", done, n, False)
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
        # T(n) for every n asked so far: the scheduler asks for the same lengths every step.
        self.lookup = _Memo(self._interpolate).__getitem__

    def time(self, n: int) -> float:
        """T(n), linear between table points (n beyond the table extrapolates the last slope)."""
        return self.lookup(n)

    def remaining(self, total: int, processed: int) -> float:
        """Time from now to the first token of a prompt of ``total`` tokens with ``processed``
        done, run alone."""
        if total <= processed:
            return 0.0
        return self.lookup(total) - self.lookup(processed) + self.drain_s

    def _interpolate(self, n: int) -> float:
        if n <= 0:
            return 0.0
        i = min(bisect.bisect_left(self.lengths, n), len(self.lengths) - 1)
        x0, x1 = self.lengths[i - 1], self.lengths[i]
        y0, y1 = self.times[i - 1], self.times[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

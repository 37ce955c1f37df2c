"""A virtual-clock driver for the live scheduler objects: the predictor is the executor.

Each iteration asks the scheduler for a plan and, when the batch comes out of the model,
hands it back with a token for every sampling chunk (``SchedulerBase.update``), as the engine
does.
Requests carry ``LengthOnlyTokens``, so a 1M-token prompt costs O(1) memory. Records use the
same JSON shape as the live runner's (``jserve.sim.trace.RECORD_FIELDS``).

Pipelines (stream pipeline parallelism): the next batch is issued one *stage time* after the
previous one (``stage_time(plan)``, the slowest stage), while the batch's sampled tokens
arrive one *latency* (``predictor.predict(plan)``, every stage) after its issue. Prefill chunks
of one request may therefore follow each other every stage time, as SPP allows; a request
waiting for its sampled token is held out of scheduling until the token arrives (it cannot
decode before). Without a ``stage_time`` the two coincide and batches run one at a time.
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Iterable

from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.plan import BatchPlan
from jserve.scheduler.predictor import RuntimePredictor
from jserve.scheduler.request import Request, RequestStatus
from jserve.sim.tokens import LengthOnlyTokens
from jserve.sim.trace import TraceRequest, empty_record

_EPS = 1e-9  # summed step times (100 x 0.05 s) may land a hair below an event time


class VirtualClock:
    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


def deliver_tokens(scheduler: SchedulerBase, records: dict, plan: BatchPlan, at: float) -> None:
    """``plan``'s sampled tokens come out at ``at``: the scheduler takes them back, the
    requests' records get them, and a request at its length finishes."""
    sampled = [0] * sum(c.samples for c in plan.decodes + plan.prefills)
    for _, req in scheduler.update(plan, sampled):
        rec = records[req.request_id]
        rec["output_tokens"] += 1
        rec["token_times_s"].append(at)
        if rec["first_token_s"] is None:
            rec["first_token_s"] = at
        if req.room(math.inf) <= 0:  # (the simulator's requests fit any context)
            scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
            rec["finish_s"] = at
            rec["finish_reason"] = RequestStatus.FINISHED_LENGTH.value


def simulate(scheduler: SchedulerBase, predictor: RuntimePredictor, clock: VirtualClock,
             trace: Iterable[TraceRequest], policy: str, *,
             stage_time: Callable[[BatchPlan], float] | None = None,
             horizon_s: float | None = None) -> list[dict]:
    """Runs the trace until every request finishes or the clock passes ``horizon_s``; returns
    one record per request in arrival order (null times for what was not reached; a request
    whose KV can never fit in the pool is aborted on arrival).
    ``stage_time`` defaults to ``predictor.stage_time`` when the predictor has one."""
    stage = stage_time or getattr(predictor, "stage_time", predictor.predict)
    pending = sorted(trace, key=lambda t: t.arrival_s)
    records = {t.request_id: empty_record(t, policy) for t in pending}
    # Plans in flight, oldest first, with the time their tokens arrive: a pipeline's stages
    # are first in, first out, so a plan never comes out before one issued earlier.
    in_flight: collections.deque[tuple[float, BatchPlan]] = collections.deque()
    i = 0

    def deliver(plan: BatchPlan, at: float) -> None:
        deliver_tokens(scheduler, records, plan, at)

    while True:
        while in_flight and in_flight[0][0] <= clock.now + _EPS:
            at, done = in_flight.popleft()
            deliver(done, at)
        while i < len(pending) and pending[i].arrival_s <= clock.now + _EPS:
            t = pending[i]
            prefix = (t.prefix_id, t.prefix_tokens) if t.prefix_id is not None else None
            req = Request(t.request_id, LengthOnlyTokens(t.prompt_tokens), t.output_tokens,
                          t.arrival_s, all_token_ids=LengthOnlyTokens(
                              t.prompt_tokens, prefix=prefix, owner=t.request_id))
            if t.ttft_deadline_s is not None:
                req.ttft_deadline = t.arrival_s + t.ttft_deadline_s
            i += 1
            if scheduler.allocator.pages_for(t.prompt_tokens + t.output_tokens) \
                    > scheduler.allocator.total:
                # It can never fit: it would be preempted and recomputed forever.
                records[t.request_id]["finish_reason"] = RequestStatus.FINISHED_ABORTED.value
                continue
            scheduler.add(req)
        if horizon_s is not None and clock.now >= horizon_s:
            break
        plan = scheduler.schedule() if scheduler.has_schedulable() else BatchPlan((), ())
        if plan.is_empty:
            events = ([in_flight[0][0]] if in_flight else []) + (
                [pending[i].arrival_s] if i < len(pending) else [])
            if events:
                clock.now = max(clock.now, min(events))
                continue
            if scheduler.has_unfinished():
                raise RuntimeError(f"{policy}: no progress possible at t={clock.now:.3f}s")
            break
        # The host tier's restores go before the step that reads them (not overlapped).
        copy = scheduler.restore_seconds(len(plan.restore)) if plan.restore else 0.0
        arrives = clock.now + copy + predictor.predict(plan)
        in_flight.append((max(arrives, in_flight[-1][0]) if in_flight else arrives, plan))
        clock.now += copy + stage(plan)
    return [records[t.request_id] for t in pending]

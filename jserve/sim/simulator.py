"""A virtual-clock driver for the live scheduler objects: the predictor is the executor.

Each iteration asks the scheduler for a plan and applies it as the engine would: computed
tokens advance, and a sampling chunk appends one token when the batch comes out of the model.
Requests carry ``LengthOnlyTokens``, so a 1M-token prompt costs O(1) memory. Records use the
same JSON shape as the live runner's (``jserve.sim.trace.RECORD_FIELDS``).

Pipelines (stream pipeline parallelism): the next batch is issued one *stage time* after the
previous one (``stage_time(plan)``, the slowest stage), while the batch's sampled tokens
arrive one *latency* (``predictor.predict(plan)``, every stage) after its issue. Prefill chunks
of one request may therefore follow each other every stage time, as SPP allows; a request
waiting for its sampled token is held out of scheduling (``SchedulerBase.hold``) until the
token arrives (it cannot decode before). Without a ``stage_time`` the two coincide and
batches run one at a time.
"""
from __future__ import annotations

import heapq
import itertools
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
    in_flight: list[tuple[float, int, list[Request]]] = []  # heap of (arrives, seq, requests)
    requests: dict[str, Request] = {}
    seq = itertools.count()
    i = 0

    def deliver(req: Request, at: float) -> None:
        scheduler.release(req)
        req.token_ids.append(0)
        rec = records[req.request_id]
        rec["output_tokens"] += 1
        rec["token_times_s"].append(at)
        if rec["first_token_s"] is None:
            rec["first_token_s"] = at
        if req.num_output_tokens >= req.max_tokens:
            scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
            rec["finish_s"] = at
            rec["finish_reason"] = RequestStatus.FINISHED_LENGTH.value

    while True:
        while in_flight and in_flight[0][0] <= clock.now + _EPS:
            at, _, reqs = heapq.heappop(in_flight)
            for req in reqs:
                deliver(req, at)
        while i < len(pending) and pending[i].arrival_s <= clock.now + _EPS:
            t = pending[i]
            prefix = (t.prefix_id, t.prefix_tokens) if t.prefix_id is not None else None
            req = Request(t.request_id, LengthOnlyTokens(t.prompt_tokens), t.output_tokens,
                          t.arrival_s, token_ids=LengthOnlyTokens(
                              t.prompt_tokens, prefix=prefix, owner=t.request_id))
            if t.ttft_deadline_s is not None:
                req.ttft_deadline = t.arrival_s + t.ttft_deadline_s
            requests[t.request_id] = req
            i += 1
            if scheduler.allocator.blocks_for(t.prompt_tokens + t.output_tokens) \
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
        arrives = clock.now + predictor.predict(plan)
        sampled = []
        for c in plan.decodes + plan.prefills:
            req = requests[c.request_id]
            scheduler.advance(req, c.num_tokens)
            if c.samples:
                sampled.append(req)
        if sampled:
            scheduler.hold(sampled)
            heapq.heappush(in_flight, (arrives, next(seq), sampled))
        clock.now += stage(plan)
    return [records[t.request_id] for t in pending]

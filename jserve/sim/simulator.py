"""A virtual-clock driver for the live scheduler objects: the predictor is the executor.

Each iteration asks the scheduler for a plan, advances the clock by the predicted step time
and applies the plan as the engine would (computed tokens advance; a sampling chunk appends
one token). Records use the same JSON shape as the live runner's.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.predictor import RuntimePredictor
from jserve.scheduler.request import Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_deadline_s: float | None = None  # relative to arrival; None: the policy's default


class VirtualClock:
    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


def simulate(scheduler: SchedulerBase, predictor: RuntimePredictor, clock: VirtualClock,
             trace: Iterable[TraceRequest], policy: str) -> list[dict]:
    """Runs the trace to completion; returns one record per request in arrival order."""
    pending = sorted(trace, key=lambda t: t.arrival_s)
    requests: dict[str, Request] = {}
    records: dict[str, dict] = {}
    i = 0
    while i < len(pending) or scheduler.has_unfinished():
        # A tolerance for summed step times (100 x 0.05 s may land a hair below 5 s).
        while i < len(pending) and pending[i].arrival_s <= clock.now + 1e-9:
            t = pending[i]
            req = Request(t.request_id, [0] * t.prompt_tokens, t.output_tokens, t.arrival_s)
            if t.ttft_deadline_s is not None:
                req.ttft_deadline = t.arrival_s + t.ttft_deadline_s
            requests[t.request_id] = req
            records[t.request_id] = {
                "request_id": t.request_id, "prompt_tokens": t.prompt_tokens,
                "output_tokens": 0, "arrival_s": t.arrival_s, "first_token_s": None,
                "finish_s": None, "finish_reason": None, "policy": policy}
            scheduler.add(req)
            i += 1
        if not scheduler.has_unfinished():
            clock.now = pending[i].arrival_s
            continue
        plan = scheduler.schedule()
        if plan.is_empty:
            raise RuntimeError(f"{policy}: no progress possible at t={clock.now:.3f}s")
        clock.now += predictor.predict(plan)
        for c in plan.decodes + plan.prefills:
            req = requests[c.request_id]
            req.num_computed += c.num_tokens
            if not c.samples:
                continue
            req.token_ids.append(0)
            rec = records[c.request_id]
            rec["output_tokens"] += 1
            if rec["first_token_s"] is None:
                rec["first_token_s"] = clock.now
            if req.num_output_tokens >= req.max_tokens:
                scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
                rec["finish_s"] = clock.now
                rec["finish_reason"] = RequestStatus.FINISHED_LENGTH.value
    return [records[t.request_id] for t in pending]

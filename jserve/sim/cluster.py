"""N simulated replicas behind a router: the cluster mode of ``jserve simulate``.

Each replica is the single-replica setup of ``jserve.sim.policies`` (its own scheduler, KV pool
and time model on its own mesh); all share one virtual clock. A request is routed the moment
it arrives, by ``jserve.routing.choose`` over the replicas' reports read from their schedulers
at that moment (``jserve.routing.replica.replica_load``, the function the live replicas'
``/v1/route/load`` endpoint calls), so the simulated figures come from the live router's
decisions. The per-request records are the single-replica ones, plus the replica's index.

Time advances from event to event: an arrival, a batch's tokens coming out of a replica, or a
replica free to issue its next batch (one stage time after the last; with no pipeline, when
the last one's tokens are out). A replica with nothing to schedule waits for its next event.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

from jserve.routing import ReplicaView, RouteRequest, choose
from jserve.routing.replica import cached_tokens, prefill_table, replica_load
from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.plan import BatchPlan
from jserve.scheduler.request import Request, RequestStatus
from jserve.sim.policies import (
    SimConfig,
    _cached_prefill_cache,
    _max_context,
    _prefill_cache,
    build,
)
from jserve.sim.simulator import VirtualClock, deliver_tokens
from jserve.sim.tokens import LengthOnlyTokens
from jserve.sim.trace import TraceRequest, empty_record

_EPS = 1e-9


@dataclasses.dataclass(eq=False)
class _Replica:
    index: int
    scheduler: SchedulerBase
    predictor: object
    table: object
    in_flight: collections.deque = dataclasses.field(default_factory=collections.deque)
    free_at: float = 0.0  # when it may issue its next batch; inf: idle until an event

    def wake(self, now: float) -> None:
        """An event for a replica that had nothing to schedule: it looks again now (a busy
        one issues its next batch when its stage is free, as before)."""
        if self.free_at == math.inf:
            self.free_at = now

    def next_event(self) -> float:
        return min(self.in_flight[0][0] if self.in_flight else math.inf, self.free_at)


def _request(t: TraceRequest) -> Request:
    prefix = (t.prefix_id, t.prefix_tokens) if t.prefix_id is not None else None
    req = Request(t.request_id, LengthOnlyTokens(t.prompt_tokens), t.output_tokens,
                  t.arrival_s, all_token_ids=LengthOnlyTokens(t.prompt_tokens, prefix=prefix,
                                                          owner=t.request_id))
    if t.ttft_deadline_s is not None:
        req.ttft_deadline = t.arrival_s + t.ttft_deadline_s
    return req


def replica_views(replicas: Sequence[_Replica], req: Request, now: float) -> list[ReplicaView]:
    """What the router sees of each replica for ``req`` at ``now``."""
    return [ReplicaView(replica_load(str(r.index), r.scheduler, r.table, now,
                                     predictor=r.predictor),
                        cached_tokens(r.scheduler, req.all_token_ids)) for r in replicas]


def make_replica(index: int, policy: str, cfg: SimConfig, clock: VirtualClock,
                 max_context: int) -> _Replica:
    """One replica of ``cfg``'s mesh scheduling with ``policy``, on ``clock``, with the
    prefill table its reports carry."""
    sched, predictor = build(policy, cfg, clock, max_context)
    cache = getattr(sched, "cache", None) or (
        _cached_prefill_cache(cfg.model, cfg.hardware, cfg.tp, cfg.spp, cfg.kvp, 1e9,
                              cfg.sarathi_chunk, max_context) if policy == "sarathi"
        else _prefill_cache(cfg, max_context))
    return _Replica(index, sched, predictor, prefill_table(cache, max_context))


def check_cluster_args(policy: str, replicas: int) -> None:
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if policy == "loongserve":
        raise ValueError("loongserve runs as one cluster of elastic instances, not behind a "
                         "router")


def fits(rep: _Replica, t: TraceRequest) -> bool:
    """Whether ``t``'s KV could ever fit in ``rep``'s pool (else it is aborted on arrival:
    it would be preempted and recomputed forever)."""
    alloc = rep.scheduler.allocator
    return alloc.pages_for(t.prompt_tokens + t.output_tokens) <= alloc.total


def deliver_due(reps: Sequence[_Replica], records: dict, now: float
                ) -> list[tuple[_Replica, BatchPlan, float]]:
    """Every batch whose tokens are out by ``now`` goes back to its replica (and the
    requests' ``records``); returns (replica, plan, time out) of each."""
    out = []
    for r in reps:
        while r.in_flight and r.in_flight[0][0] <= now + _EPS:
            at, plan = r.in_flight.popleft()
            deliver_tokens(r.scheduler, records, plan, at)
            r.wake(now)
            out.append((r, plan, at))
    return out


def issue_due(reps: Sequence[_Replica], now: float) -> list[tuple[_Replica, BatchPlan]]:
    """Every replica free at ``now`` issues its next batch (one with nothing to schedule
    waits for an event); returns (replica, plan) of each batch issued."""
    out = []
    for r in reps:
        if r.free_at > now + _EPS:
            continue
        sched = r.scheduler
        plan = sched.schedule() if sched.has_schedulable() else BatchPlan((), ())
        if plan.is_empty:
            r.free_at = math.inf  # until tokens come out or a request arrives
            continue
        arrives = now + r.predictor.predict(plan)
        r.in_flight.append((max(arrives, r.in_flight[-1][0]) if r.in_flight else arrives,
                            plan))
        stage = getattr(r.predictor, "stage_time", r.predictor.predict)
        r.free_at = now + stage(plan)
        out.append((r, plan))
    return out


def check_finished(reps: Sequence[_Replica], policy: str, cfg: SimConfig, now: float,
                   what: str = "replica") -> None:
    for r in reps:
        if cfg.horizon_s is None and r.scheduler.has_unfinished():
            raise RuntimeError(f"{policy}: {what} {r.index} made no progress at "
                               f"t={now:.3f}s")


def run_cluster(trace: Sequence[TraceRequest], policy: str, router: str, replicas: int,
                cfg: SimConfig | None = None) -> list[dict]:
    """Simulates ``trace`` on ``replicas`` replicas of ``cfg``'s mesh, each scheduling with
    ``policy``, behind ``router``; one record per request in arrival order (with
    ``replica``: where it was sent)."""
    cfg = cfg or SimConfig()
    check_cluster_args(policy, replicas)
    clock = VirtualClock()
    max_context = _max_context(trace)
    reps = [make_replica(i, policy, cfg, clock, max_context) for i in range(replicas)]
    pending = sorted(trace, key=lambda t: t.arrival_s)
    records = {t.request_id: empty_record(t, policy) for t in pending}
    i = 0

    while True:
        t = min([pending[i].arrival_s if i < len(pending) else math.inf]
                + [r.next_event() for r in reps])
        if t == math.inf:
            break
        if cfg.horizon_s is not None and t >= cfg.horizon_s:
            break
        clock.now = max(clock.now, t)
        now = clock.now
        deliver_due(reps, records, now)
        while i < len(pending) and pending[i].arrival_s <= now + _EPS:
            tr = pending[i]
            i += 1
            if not fits(reps[0], tr):
                records[tr.request_id]["finish_reason"] = RequestStatus.FINISHED_ABORTED.value
                continue
            req = _request(tr)
            k = choose(router, RouteRequest(tr.prompt_tokens, tr.ttft_deadline_s, i - 1),
                       replica_views(reps, req, now))
            records[tr.request_id]["replica"] = k
            reps[k].scheduler.add(req)
            reps[k].wake(now)
        issue_due(reps, now)
    check_finished(reps, policy, cfg, clock.now)
    return [records[t.request_id] for t in pending]

"""Prefill/decode disaggregation in the simulator: ``prefill_replicas`` prefill-only replicas
and ``decode_replicas`` decode replicas (which also prefill colocated when a request is
placed so) on one virtual clock, each request placed at its arrival by
``jserve.routing.disagg.place`` over the replicas' reports, as the live front end does.

A disaggregated request runs its prompt on its prefill replica as a request of one output
token. When that token is out, its KV pages cross to the decode replica: ``TransferCost``
seconds (``transfer_cost``: one GPU's share of a token's KV over one GPU's link, every GPU
sending its own shard at once), after the links' earlier transfers (each replica's link moves
one prompt at a time, first come first served). Then the decode replica imports them as the
live decode engine does: it allocates the pages in its ``PageAllocator``, registers each
under the request's own page keys (those its ``LengthOnlyTokens`` give through
``jserve.cache.prefix.extend_page_keys``), frees them (they become idle cached pages) and
adds the request, whose prefix lookup at admission then finds them: only the prompt's last
page and the first token are computed there. That needs the decode replicas' prefix cache,
which ``decode_config`` turns on for a disaggregated run. A decode replica without room for
the import (free plus idle pages) recomputes the prompt (``kv_import`` "recomputed"); pages
imported but evicted before the request's admission are recomputed too
(``decode_prompt_tokens`` shows it). The prefill replica's pages are not held during the
transfer (its prefix cache keeps them idle, evictable). The decode replica is chosen at
arrival (what ``place`` returns), not when the prefill ends.

Records: ``run_cluster``'s (``replica`` is the decode replica's index), plus
``prefill_replica`` (None: colocated), ``transfer_s`` (prefill done to KV imported, link
queueing included; 0 colocated), ``kv_import`` (None, "imported", "recomputed"),
``prefill_done_s`` and ``decode_prompt_tokens`` (prompt tokens the decode replica computed).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from typing import Sequence

from jserve.cache.prefix import extend_page_keys
from jserve.routing import MODES, RouteRequest, TransferCost, place
from jserve.scheduler.plan import BatchPlan
from jserve.scheduler.request import Request, RequestStatus
from jserve.sim.cluster import (
    _EPS,
    _Replica,
    _request,
    check_cluster_args,
    check_finished,
    deliver_due,
    fits,
    issue_due,
    make_replica,
    replica_views,
)
from jserve.sim.policies import SimConfig, _max_context, _time_model
from jserve.sim.simulator import VirtualClock
from jserve.sim.trace import TraceRequest, empty_record

# One GPU's link to another node: a 200 Gb/s InfiniBand HDR (or NDR-200) NIC per GPU, as a
# DGX A100 node has (8 compute NICs for 8 GPUs, no NVLink between nodes).
TRANSFER_GB_PER_S = 25.0


def transfer_cost(cfg: SimConfig, gb_per_s: float = TRANSFER_GB_PER_S,
                  latency_s: float = 0.0) -> TransferCost:
    """Prefill and decode replicas on the same mesh: each GPU holds the same shard of a
    token's KV on both (``kv_token_bytes``) and sends it over its own link at ``gb_per_s``."""
    model = _time_model(cfg.model, cfg.hardware, cfg.tp, cfg.spp, cfg.kvp)
    return TransferCost(model.kv_token_bytes(), gb_per_s * 1e9, latency_s, cfg.page_size)


def decode_config(cfg: SimConfig, mode: str, prefill_replicas: int) -> SimConfig:
    """The decode replicas' config: ``cfg``, with prefix caching on when requests may arrive
    with imported KV (the import is found by the prefix lookup)."""
    if mode == "never" or prefill_replicas == 0 or cfg.prefix_caching:
        return cfg
    return dataclasses.replace(cfg, prefix_caching=True)


def import_pages(rep: _Replica, req: Request) -> bool:
    """The decode replica takes ``req``'s prompt KV: its full pages allocated, registered
    under the request's page keys and freed (idle cached pages its admission's lookup finds).
    False (nothing changed) when its pool has no room for them."""
    alloc = rep.scheduler.allocator
    n = req.num_prompt_tokens // alloc.page_size
    if not alloc.prefix_caching or not alloc.can_allocate(n):
        return False
    pages = alloc.allocate(n)
    keys = extend_page_keys([], req.all_token_ids, alloc.page_size, n, req.adapter)
    for page, key in zip(pages, keys):
        alloc.register(page, key)
    alloc.free(pages)
    return True


@dataclasses.dataclass(eq=False)
class _Disagg:
    """A disaggregated run's state: the two pools, the transfers under way, the links."""

    prefill: list[_Replica]
    decode: list[_Replica]
    transfer: TransferCost
    records: dict
    prefill_records: dict = dataclasses.field(default_factory=dict)
    traces: dict = dataclasses.field(default_factory=dict)
    deadlines: dict = dataclasses.field(default_factory=dict)
    transfers: list = dataclasses.field(default_factory=list)  # heap (done, seq, id)
    egress: dict = dataclasses.field(default_factory=dict)     # prefill replica -> free at
    ingress: dict = dataclasses.field(default_factory=dict)    # decode replica -> free at
    _seq: itertools.count = dataclasses.field(default_factory=itertools.count)

    def next_event(self) -> float:
        return min([self.transfers[0][0] if self.transfers else math.inf]
                   + [r.next_event() for r in (*self.prefill, *self.decode)])

    def arrive(self, tr: TraceRequest, seq: int, mode: str, now: float) -> None:
        req = _request(tr)
        rec = self.records[tr.request_id]
        views = replica_views(self.decode, req, now)
        p_views = replica_views(self.prefill, req, now)
        where = place(mode, RouteRequest(tr.prompt_tokens, tr.ttft_deadline_s, seq), views,
                      p_views, self.transfer)
        rec.update(replica=where.decode, prefill_replica=where.prefill)
        self.traces[tr.request_id] = tr
        if where.prefill is None:
            rep = self.decode[where.decode]
        else:  # the prompt alone, for one token
            rep = self.prefill[where.prefill]
            req = _request(dataclasses.replace(tr, output_tokens=1))
            self.prefill_records[tr.request_id] = empty_record(tr, rec["policy"])
        rep.scheduler.add(req)
        self.deadlines[tr.request_id] = req.ttft_deadline
        rep.wake(now)

    def prefilled(self, rep: _Replica, plan: BatchPlan, at: float) -> None:
        """``plan``'s tokens are out on prefill replica ``rep``: each request it finished
        starts its transfer once both links are free."""
        for c in plan.prefills:
            prec = self.prefill_records[c.request_id]
            if not c.samples or prec["finish_s"] is None:
                continue
            rec = self.records[c.request_id]
            d = rec["replica"]
            start = max(at, self.egress.get(rep.index, 0.0), self.ingress.get(d, 0.0))
            done = start + self.transfer.seconds(rec["prompt_tokens"])
            self.egress[rep.index] = self.ingress[d] = done
            rec["prefill_done_s"] = at
            heapq.heappush(self.transfers, (done, next(self._seq), c.request_id))

    def land(self, now: float) -> None:
        """Every transfer done by ``now``: the decode replica imports the KV and queues the
        request."""
        while self.transfers and self.transfers[0][0] <= now + _EPS:
            done, _, rid = heapq.heappop(self.transfers)
            rec = self.records[rid]
            rep = self.decode[rec["replica"]]
            req = _request(self.traces[rid])
            req.ttft_deadline = self.deadlines[rid]  # the request's own, set at arrival
            rec["transfer_s"] = done - rec["prefill_done_s"]
            rec["kv_import"] = "imported" if import_pages(rep, req) else "recomputed"
            rep.scheduler.add(req)
            rep.wake(now)

    def count_prompt(self, issued: list[tuple[_Replica, BatchPlan]]) -> None:
        """Prompt tokens each request's decode-replica prefill chunks compute."""
        for _, plan in issued:
            for c in plan.prefills:
                rec = self.records[c.request_id]
                end = min(c.start + c.num_tokens, rec["prompt_tokens"])
                rec["decode_prompt_tokens"] += max(end - c.start, 0)


def _check(policy: str, mode: str, prefill_replicas: int, decode_replicas: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_cluster_args(policy, decode_replicas)
    if prefill_replicas < 0:
        raise ValueError(f"prefill_replicas must be >= 0, got {prefill_replicas}")


def run_disagg(trace: Sequence[TraceRequest], policy: str, prefill_replicas: int,
               decode_replicas: int, mode: str = "auto", cfg: SimConfig | None = None,
               transfer: TransferCost | None = None) -> list[dict]:
    """Simulates ``trace`` on ``prefill_replicas`` prefill-only and ``decode_replicas`` decode
    replicas of ``cfg``'s mesh, each scheduling with ``policy``, every request placed by
    ``place(mode, ...)``; ``transfer`` defaults to ``transfer_cost(cfg)``. One record per
    request in arrival order (the module docstring lists the fields)."""
    return simulate_disagg(trace, policy, prefill_replicas, decode_replicas, mode, cfg,
                           transfer)[0]


def simulate_disagg(trace: Sequence[TraceRequest], policy: str, prefill_replicas: int,
                    decode_replicas: int, mode: str = "auto", cfg: SimConfig | None = None,
                    transfer: TransferCost | None = None) -> tuple[list[dict], _Disagg]:
    """``run_disagg``, and the run's replicas after it (their schedulers and KV pools)."""
    cfg = cfg or SimConfig()
    _check(policy, mode, prefill_replicas, decode_replicas)
    clock = VirtualClock()
    max_context = _max_context(trace)
    dcfg = decode_config(cfg, mode, prefill_replicas)
    pending = sorted(trace, key=lambda t: t.arrival_s)
    records = {t.request_id: dict(empty_record(t, policy), prefill_replica=None,
                                  transfer_s=0.0, kv_import=None, prefill_done_s=None,
                                  decode_prompt_tokens=0) for t in pending}
    run = _Disagg([make_replica(i, policy, cfg, clock, max_context)
                   for i in range(prefill_replicas)],
                  [make_replica(i, policy, dcfg, clock, max_context)
                   for i in range(decode_replicas)],
                  transfer or transfer_cost(cfg), records)
    i = 0
    while True:
        t = min(pending[i].arrival_s if i < len(pending) else math.inf, run.next_event())
        if t == math.inf or (cfg.horizon_s is not None and t >= cfg.horizon_s):
            break
        clock.now = max(clock.now, t)
        now = clock.now
        for rep, plan, at in deliver_due(run.prefill, run.prefill_records, now):
            run.prefilled(rep, plan, at)
        deliver_due(run.decode, records, now)
        run.land(now)
        while i < len(pending) and pending[i].arrival_s <= now + _EPS:
            tr = pending[i]
            i += 1
            if not fits(run.decode[0], tr):
                records[tr.request_id]["finish_reason"] = RequestStatus.FINISHED_ABORTED.value
                continue
            run.arrive(tr, i - 1, mode, now)
        issue_due(run.prefill, now)
        run.count_prompt(issue_due(run.decode, now))
    check_finished(run.prefill, policy, cfg, clock.now, "prefill replica")
    check_finished(run.decode, policy, cfg, clock.now, "decode replica")
    return [records[t.request_id] for t in pending], run


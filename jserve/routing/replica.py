"""A replica's report, read from its scheduler: the one function the live engine (the
``/v1/route/load`` endpoint, Ray Serve's routing stats) and the simulator's cluster mode both
call, so a router sees the same numbers from either.

Call it where the scheduler is not being changed (the engine thread between steps, or the
simulator between events)."""
from __future__ import annotations

import math
from typing import Sequence

from jserve.cache.prefix import extend_page_keys
from jserve.routing.load import DEADLINE_ORDER, FIFO, PrefillTable, QueuedPrefill, ReplicaLoad
from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.scheduler.predictor import RuntimePredictor
from jserve.scheduler.registry import POLICIES


def prefill_table(cache: PrefillTimeCache, max_len: int) -> PrefillTable:
    """The scheduler's isolated prefill times, sampled for a report."""
    return PrefillTable.sample(cache.time, max(max_len, 2), drain_s=cache.drain_s)


def cached_tokens(scheduler: SchedulerBase, token_ids: Sequence[int]) -> int:
    """Leading prompt tokens of ``token_ids`` this replica's prefix cache holds now (whole
    pages, leaving the last token to compute, as admission would take them)."""
    alloc = scheduler.allocator
    if not alloc.prefix_caching or len(token_ids) < 2:
        return 0
    pages = (len(token_ids) - 1) // alloc.page_size
    return len(alloc.lookup(extend_page_keys([], token_ids, alloc.page_size, pages))) \
        * alloc.page_size


def replica_load(name: str, scheduler: SchedulerBase, table: PrefillTable, now: float, *,
                 healthy: bool = True, predictor: RuntimePredictor | None = None
                 ) -> ReplicaLoad:
    """The report of ``scheduler`` at time ``now`` (its clock's): every request with prompt
    left, with its deadline and remaining isolated prefill work by ``table``; with
    ``predictor``, the iteration budget and the running decodes' time in it."""
    config = getattr(scheduler, "config", None)
    entry = POLICIES.get(getattr(scheduler, "policy", ""))
    deadline_order = entry is not None and entry.deadline_order
    prefills, decodes = [], []
    for req in (*scheduler.running, *scheduler.waiting):
        total, done = len(req.all_token_ids), req.num_done
        if req.status.finished or total - done < 1:
            continue
        if req.num_output_tokens and total - done == 1:
            decodes.append(ScheduledChunk(req.request_id, total - 1, 1, True))
            continue
        due = (req.ttft_deadline - now if req.ttft_deadline is not None
               and not req.num_output_tokens else math.inf)
        prefills.append(QueuedPrefill(due, table.remaining(total, done), total - done))
    alloc = scheduler.allocator
    t_target, decode_s = getattr(config, "t_target", 0.0), 0.0
    if predictor is not None:
        t_target = t_target or predictor.predict(BatchPlan((), (
            ScheduledChunk("_", 0, scheduler.token_budget, False),)))
        decode_s = predictor.predict(BatchPlan(tuple(decodes), ())) if decodes else 0.0
    return ReplicaLoad(
        replica=name, healthy=healthy, waiting=len(scheduler.waiting),
        running=len(scheduler.running), kv_usage=alloc.num_allocated / max(alloc.total, 1),
        order=DEADLINE_ORDER if deadline_order else FIFO, prefills=tuple(prefills),
        table=table, long_threshold=getattr(config, "long_threshold", 32768),
        t_target=t_target, decode_s=decode_s, quick_s=getattr(scheduler, "quick_s", 0.0),
        max_num_seqs=scheduler.max_num_seqs)

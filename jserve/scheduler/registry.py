"""Policy name -> scheduler object, shared by the live engine and the simulator so a name means
the same policy everywhere."""
from __future__ import annotations

import time
from typing import Callable

from jserve.cache.allocator import BlockAllocator
from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import DEADLINE_POLICIES, DeadlineConfig, DeadlineScheduler
from jserve.scheduler.predictor import RuntimePredictor
from jserve.scheduler.sarathi import SarathiScheduler
from jserve.scheduler.sprpt import SPRPTScheduler

POLICIES = ("sarathi",) + DEADLINE_POLICIES + ("sprpt",)


def build_scheduler(policy: str, allocator: BlockAllocator, *, max_num_seqs: int,
                    max_num_batched_tokens: int, max_prefill_seqs: int,
                    predictor: RuntimePredictor | None = None, max_context: int | None = None,
                    deadline: DeadlineConfig = DeadlineConfig(),
                    clock: Callable[[], float] = time.monotonic,
                    prefill_cache: PrefillTimeCache | None = None, sprpt_c: float = 0.8,
                    fallback_remaining: float | None = None) -> SchedulerBase:
    """Deadline-aware policies need a predictor and either the longest context (to build the
    prefill-time cache) or a ready cache; ``sarathi`` needs none of them; ``sprpt`` takes its
    preemption window ``sprpt_c`` and the remaining length assumed before a prediction."""
    limits = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                  max_prefill_seqs=max_prefill_seqs)
    if policy == "sarathi":
        return SarathiScheduler(allocator, **limits)
    if policy == "sprpt":
        return SPRPTScheduler(allocator, c=sprpt_c, fallback_remaining=fallback_remaining,
                              **limits)
    if policy not in DEADLINE_POLICIES:
        raise ValueError(f"scheduler must be one of {POLICIES}, got {policy!r}")
    if predictor is None or (max_context is None and prefill_cache is None):
        raise ValueError(f"policy {policy!r} needs a runtime predictor and max_context")
    cache = prefill_cache or PrefillTimeCache(predictor, max_context, deadline.t_target,
                                              chunk_granularity=deadline.chunk_granularity,
                                              max_chunk=max_num_batched_tokens)
    return DeadlineScheduler(allocator, policy=policy, predictor=predictor, prefill_cache=cache,
                             config=deadline, clock=clock, **limits)

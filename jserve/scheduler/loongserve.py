"""A LoongServe-like baseline: non-preemptive FCFS prefills with elastic sequence parallelism.

LoongServe (Wu et al., SOSP 2024) runs each prefill over as many model instances as its length
calls for (ESP) and never preempts it. Here: a request's ESP degree is fixed on arrival from
its prompt length (``esp_degree``); prefills run strictly in arrival order, each to completion
(the whole remaining prompt every iteration, up to the token budget) before the next starts;
a later prefill joins an iteration only when the ones ahead of it finish in it. Decodes of
running requests go into every iteration. The degree reaches the predicted time through
``degree_of``, which ``jserve.sim.esp.EspTimeModel`` reads.
"""
from __future__ import annotations

import itertools

from jserve.cache.allocator import BlockAllocator
from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.plan import BatchPlan
from jserve.scheduler.request import Request, RequestStatus


def esp_degree(num_prompt_tokens: int, num_instances: int, tokens_per_instance: int) -> int:
    """Smallest power of two d with d * tokens_per_instance >= the prompt, at most the number
    of instances: a short prompt stays on one instance, a long one spreads out."""
    d = 1
    while d * tokens_per_instance < num_prompt_tokens and d < num_instances:
        d *= 2
    return min(d, num_instances)


class LoongServeScheduler(SchedulerBase):
    def __init__(self, allocator: BlockAllocator, *, num_instances: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_prefill_seqs: int,
                 tokens_per_instance: int = 65_536):
        if num_instances < 1 or tokens_per_instance < 1:
            raise ValueError("num_instances and tokens_per_instance must be >= 1")
        super().__init__(allocator, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_prefill_seqs=max_prefill_seqs)
        self.num_instances = num_instances
        self.tokens_per_instance = tokens_per_instance
        self._degrees: dict[str, int] = {}

    def add(self, req: Request) -> None:
        self._degrees[req.request_id] = esp_degree(req.num_prompt_tokens, self.num_instances,
                                                   self.tokens_per_instance)
        super().add(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        super().finish(req, status)
        self._degrees.pop(req.request_id, None)

    def degree_of(self, request_id: str) -> int:
        return self._degrees.get(request_id, 1)

    def _schedule_once(self, admit: bool) -> BatchPlan:
        decodes, preempted = self._schedule_decodes(self.max_num_seqs)
        budget = self.token_budget - len(decodes)
        scheduled = {c.request_id for c in decodes}
        # Started prefills first (admission order), then the queue: nobody overtakes.
        queue = [r for r in self.running if r.request_id not in scheduled and not r.is_decode
                 and r.num_uncomputed > 0]
        if admit and not preempted:
            queue += itertools.islice(self.waiting, self.max_prefill_seqs)
        prefills = []
        for req in queue:
            if budget <= 0 or len(prefills) == self.max_prefill_seqs:
                break
            waiting = req.status is not RequestStatus.RUNNING
            if waiting and len(self.running) >= self.max_num_seqs:
                break
            n = self._fits(req, min(req.num_uncomputed, budget))
            if n == 0 or not self._grow(req, req.num_computed + n):
                break
            if waiting:
                self._admit(req)
            prefills.append(self._chunk(req, n))
            budget -= n
            if n < req.num_uncomputed:
                break  # the head is not done: whoever is behind it waits
        return BatchPlan(tuple(decodes), tuple(prefills), tuple(preempted))

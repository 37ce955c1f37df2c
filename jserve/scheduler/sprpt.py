"""SPRPT with limited preemption (TRAIL): shortest predicted remaining tokens first.

Waiting and running requests are ordered by ``predicted_remaining``. A request whose prompt
has not been prefilled yet has no prediction and counts as ``fallback_remaining`` (the probe's
``prior_mean``, the mean output length of its training requests; its ``max_tokens`` when none
is given); ties go by arrival. A running request may be preempted by policy only while it has
generated at most ``c`` times its first prediction (c = 1: plain SPRPT; c = 0: never; one
still prefilling counts as generated 0, so c > 0 allows it): early preemption is cheap, late
preemption wastes the memory and work a long request already holds. When the shortest
waiting request cannot be admitted because the batch is full (``max_num_seqs`` or KV), the
preemptable running request with the largest prediction is preempted if that prediction is
larger than the waiting one's. Prefills are chunked under the token budget as in Sarathi;
memory-pressure preemption also takes the largest prediction (preemptable ones first).
"""
from __future__ import annotations

from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.plan import BatchPlan
from jserve.scheduler.request import Request


class SPRPTScheduler(SchedulerBase):
    def __init__(self, allocator, *, c: float = 0.8, fallback_remaining: float | None = None,
                 **limits):
        super().__init__(allocator, **limits)
        if not c >= 0:
            raise ValueError(f"sprpt preemption window c must be >= 0, got {c}")
        self.c = c
        self.fallback_remaining = fallback_remaining
        self.num_policy_preemptions = 0

    def remaining(self, req: Request) -> float:
        if req.predicted_remaining is not None:
            return req.predicted_remaining
        return self.fallback_remaining if self.fallback_remaining is not None else req.max_tokens

    def _key(self, req: Request) -> tuple[float, float]:
        return self.remaining(req), req.arrival_time

    def preemptable(self, req: Request) -> bool:
        """The preemption window: generated <= c x first prediction."""
        if self.c == 0:
            return False
        if req.first_prediction is None:
            return True
        return req.num_output_tokens <= self.c * req.first_prediction

    def _victim(self) -> Request:
        window = [r for r in self.running if self.preemptable(r)]
        return max(window or self.running, key=self._key)

    def _blocked(self, req: Request) -> bool:
        """The batch is full for ``req``: no seat, or no KV for the rest of its prompt."""
        if len(self.running) >= self.max_num_seqs:
            return True
        need = self.allocator.pages_held(len(req.all_token_ids)) - len(req.held_page_ids)
        return not self.allocator.can_allocate(max(need, 0))

    def _policy_preemptions(self) -> list[str]:
        preempted: list[str] = []
        while self.waiting:
            cand = min(self.waiting, key=self._key)
            if not self._blocked(cand):
                break
            window = [r for r in self.running if self.preemptable(r)]
            if not window:
                break
            victim = max(window, key=self._key)
            if self._key(victim) <= self._key(cand):
                break
            self._preempt(victim)
            self.num_policy_preemptions += 1
            preempted.append(victim.request_id)
        return preempted

    def _schedule_once(self, admit: bool) -> BatchPlan:
        policy_preempted = self._policy_preemptions() if admit else []
        decodes, preempted = self._schedule_decodes(self.token_budget)
        budget = self.token_budget - len(decodes)
        scheduled = {c.request_id for c in decodes}
        prefills, budget, _ = self._continue_prefills(
            sorted((r for r in self.running if r.request_id not in scheduled
                    and not r.is_decode), key=self._key), budget)

        # As in Sarathi, no admissions in a step that memory pressure forced to preempt; and
        # a request this step preempted by policy waits at least one step.
        just_out = set(policy_preempted)
        while (admit and not preempted and budget > 0
               and len(prefills) < self.max_prefill_seqs
               and len(self.running) < self.max_num_seqs):
            ready = [r for r in self.waiting
                     if r.request_id not in just_out and not self._adapter_blocked(r)]
            if not ready:
                break
            req = min(ready, key=self._key)
            chunk = self._admit_first_chunk(req, budget)
            if chunk is None:
                break
            prefills.append(chunk)
            budget -= chunk.num_tokens

        return BatchPlan(tuple(decodes), tuple(prefills), tuple(policy_preempted + preempted))

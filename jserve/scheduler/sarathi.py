"""Sarathi-Serve's iteration-level policy: decodes first, then prefill chunks in arrival order
under a token budget. It stays as the ``sarathi`` baseline beside deadline-aware policies."""
from __future__ import annotations

from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.plan import BatchPlan, ScheduledChunk


class SarathiScheduler(SchedulerBase):
    def _schedule_once(self, admit: bool) -> BatchPlan:
        decodes, preempted = self._schedule_decodes(self.token_budget)
        budget = self.token_budget - len(decodes)
        prefills: list[ScheduledChunk] = []
        scheduled = {c.request_id for c in decodes}

        candidates = [r for r in self.running
                      if r.request_id not in scheduled and not r.is_decode]
        spanning = False  # a prefill whose prompt spans kvp groups is in the batch
        for req in candidates:
            if budget == 0 or len(prefills) == self.max_prefill_seqs:
                break
            spans = self._spans_groups(req)
            if spans and spanning:
                continue
            chunk = self._fits(req, min(req.num_uncomputed, budget))
            if chunk == 0 or not self._grow(req, req.num_computed + chunk):
                continue
            prefills.append(self._chunk(req, chunk))
            budget -= chunk
            spanning |= spans

        # No admissions in a step that had to preempt: memory is short, and readmitting the
        # victim at once would only thrash.
        while (admit and not preempted and self.waiting and budget > 0
               and len(prefills) < self.max_prefill_seqs
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            spans = self._spans_groups(req)
            if spans and spanning:  # in arrival order: it waits for the next batch
                break
            chunk = self._fits(req, min(req.num_uncomputed, budget))
            if chunk == 0 or not self._grow(req, req.num_computed + chunk):
                break
            self._admit(req)
            prefills.append(self._chunk(req, chunk))
            budget -= chunk
            spanning |= spans

        return BatchPlan(tuple(decodes), tuple(prefills), tuple(preempted))

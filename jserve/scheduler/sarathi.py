"""Sarathi-Serve's iteration-level policy: decodes first, then prefill chunks in arrival order
under a token budget. It stays as the ``sarathi`` baseline beside deadline-aware policies."""
from __future__ import annotations

from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.plan import BatchPlan


class SarathiScheduler(SchedulerBase):
    def _schedule_once(self, admit: bool) -> BatchPlan:
        decodes, preempted = self._schedule_decodes(self.token_budget)
        budget = self.token_budget - len(decodes)
        scheduled = {c.request_id for c in decodes}
        prefills, budget, spanning = self._continue_prefills(
            [r for r in self.running if r.request_id not in scheduled and not r.is_decode],
            budget)

        # No admissions in a step that had to preempt: memory is short, and readmitting the
        # victim at once would only thrash.
        while (admit and not preempted and self.waiting and budget > 0
               and len(prefills) < self.max_prefill_seqs
               and len(self.running) < self.max_num_seqs):
            # In arrival order, past requests whose adapter has no slot now (vLLM's rule)
            req = next((r for r in self.waiting if not self._adapter_blocked(r)), None)
            if req is None:
                break
            spans = self._spans_groups(req)
            if spans and spanning:  # in arrival order: it waits for the next batch
                break
            chunk = self._admit_first_chunk(req, budget)
            if chunk is None:
                break
            prefills.append(chunk)
            budget -= chunk.num_tokens
            spanning |= spans

        return BatchPlan(tuple(decodes), tuple(prefills), tuple(preempted))

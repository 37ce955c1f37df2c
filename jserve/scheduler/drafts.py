"""Speculative decoding's part of the scheduler (``SchedulerBase``): the drafts a plan's
decodes take, and a speculating decode's verification when its step is back. Functions of
the scheduler (``self``: a ``SchedulerBase``, not imported: it imports this), so the
policies' hooks (``_fits``, ``_drafts_fit``) still decide."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.scheduler.request import Request


def with_drafts(self, plan: BatchPlan) -> BatchPlan:
    """Drafts go in last: each decode whose request offers ``draft_ids`` takes as many
    as the token budget, its KV room (no preemption for drafts; with kvp, up to its
    group's end) and ``_drafts_fit`` (the deadline policies' time budget) leave, so
    drafts never displace a prefill chunk or another decode. The offers are used up."""
    by_id = {c.request_id: j for j, c in enumerate(plan.decodes)}
    offers = [(by_id[r.request_id], r) for r in self.running
              if r.draft_ids and r.request_id in by_id]
    if not offers:
        return plan
    decodes = list(plan.decodes)
    tokens_left = self.token_budget - plan.num_tokens
    for j, req in sorted(offers, key=lambda o: o[0]):
        drafts, req.draft_ids = req.draft_ids, []
        c = decodes[j]
        k = min(len(drafts), tokens_left, self._fits(req, 1 + len(drafts)) - 1)
        while k > 0:
            decodes[j] = c._replace(num_tokens=1 + k, drafts=tuple(drafts[:k]))
            trial = dataclasses.replace(plan, decodes=tuple(decodes))
            if self._drafts_fit(trial):
                break
            k -= 1
        if k <= 0 or not self._grow(req, c.start + 1 + k):
            decodes[j] = c
            continue
        plan, tokens_left = trial, tokens_left - k
    return dataclasses.replace(plan, decodes=tuple(decodes))


def verify(self, req: Request, c: ScheduledChunk, sampled: Sequence[int], i: int
            ) -> list[tuple[int, Request]]:
    """A speculating decode is back: ``sampled[i + j]`` is the token after its j-th
    input (its own token, then the drafts). The drafts the samples agree with are
    accepted, plus the sample after the last of them (the sampler already replaced a
    rejected draft); the KV of rejected drafts is dropped and the pages past the
    accepted tokens go back to the pool."""
    got = sampled[i:i + 1 + len(c.drafts)]
    accepted = 0
    for draft, token in zip(c.drafts, got):
        if draft != token:
            break
        accepted += 1
    del req.all_token_ids[c.start + 1:]
    req.all_token_ids.extend(got[:accepted + 1])
    req.num_computed = c.start + 1 + accepted
    keep = self.allocator.pages_for(req.num_computed)
    if len(req.page_ids) > keep:
        self.allocator.free(req.page_ids[keep:])
        del req.page_ids[keep:]
    self._register_pages(req, req.num_computed)
    req.num_drafted += len(c.drafts)
    req.num_accepted += accepted
    self.num_draft_tokens += len(c.drafts)
    self.num_accepted_tokens += accepted
    self.num_draft_steps += 1
    return [(i + j, req) for j in range(accepted + 1)]

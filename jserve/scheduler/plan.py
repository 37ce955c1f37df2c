"""BatchPlan: the only thing that crosses from scheduler to engine."""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple


class ScheduledChunk(NamedTuple):
    """A NamedTuple: the scheduler builds one per decode every iteration, and a tuple is
    several times cheaper to make than a frozen dataclass."""

    request_id: str
    start: int        # first token position computed in this step
    num_tokens: int   # tokens computed in this step (1 for a decode, 1 + k speculating)
    samples: bool     # the chunk reaches the end of the known tokens: sample a new one
    # Speculative decoding: the k draft tokens a decode verifies after its own token (its
    # chunk is 1 + k tokens and samples at each of them; ``SchedulerBase.update`` accepts
    # the longest prefix the samples agree with).
    drafts: tuple[int, ...] = ()


PageMove = tuple[str, tuple[int, ...]]  # (request id, KV pages in token order)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """One iteration. Before running it the engine copies ``swap_out`` pages to host memory
    (their ids may be reused by this very plan), then ``swap_in`` host copies into their new
    pages."""

    decodes: tuple[ScheduledChunk, ...]
    prefills: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...] = ()
    swap_out: tuple[PageMove, ...] = ()
    swap_in: tuple[PageMove, ...] = ()
    # Decode steps the plan runs in one go (``jserve.engine.batch.burst``): every chunk is a
    # decode, computes ``burst`` tokens and samples ``burst`` tokens, one a step.
    burst: int = 1
    # The prefix cache's host tier (``jserve.cache.host_tier``): evicted cached pages copied
    # out, (device page, host slot), and host copies restored, (host slot, device page).
    # Every read of the device (swap_out, offload) comes before any write (swap_in, restore).
    offload: tuple[tuple[int, int], ...] = ()
    restore: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return (len(self.decodes) + self.num_draft_tokens
                + sum(c.num_tokens for c in self.prefills))

    @functools.cached_property
    def num_draft_tokens(self) -> int:
        """Kept once asked (the engine asks several times a step; the plan never changes)."""
        return sum(len(c.drafts) for c in self.decodes)

    @property
    def num_decode_rows(self) -> int:
        """Decode rows of the step: one per decode token, drafts included."""
        return len(self.decodes) + self.num_draft_tokens

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


def with_chunk(plan: BatchPlan, request_id: str, start: int, n: int, samples: bool) -> BatchPlan:
    """``plan`` with one more prefill chunk (what the packer prices a chunk size by)."""
    # BatchPlan(...) rather than dataclasses.replace: the scheduler extends a plan for every
    # chunk it packs, and replace() costs several times more.
    chunk = ScheduledChunk(request_id, start, n, samples)
    return BatchPlan(plan.decodes, plan.prefills + (chunk,), plan.preempted, plan.swap_out,
                     plan.swap_in)

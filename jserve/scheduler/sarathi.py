"""Sarathi-Serve's iteration-level policy: decodes first, then prefill chunks in arrival order
under a token budget. It stays as the ``sarathi`` baseline beside deadline-aware policies."""
from __future__ import annotations

import collections
import dataclasses

from jserve.cache.allocator import BlockAllocator
from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.scheduler.request import Request, RequestStatus


class SarathiScheduler:
    def __init__(self, allocator: BlockAllocator, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_prefill_seqs: int):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.max_prefill_seqs = max_prefill_seqs
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    # -- queue management --------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (done, failed or aborted) and free its blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = status

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- blocks ------------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        self.allocator.free(req.block_ids)
        req.block_ids = []

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make ``req`` own enough blocks for ``num_tokens`` KV entries."""
        need = self.allocator.blocks_for(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        req.block_ids.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the KV, requeue at the head of the waiting queue."""
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _fits(self, req: Request, max_chunk: int) -> int:
        """Largest chunk <= max_chunk whose KV fits in req's blocks plus the free pool."""
        capacity = (len(req.block_ids) + self.allocator.num_free) * self.allocator.block_size
        return max(0, min(max_chunk, capacity - req.num_computed))

    # -- the policy --------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        plan = self._schedule_once(admit=True)
        preempted = list(plan.preempted)
        while plan.is_empty and self.running:
            # Running prefills hold blocks none of them can grow into: free the newest.
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            plan = self._schedule_once(admit=False)
            preempted.extend(plan.preempted)
        return dataclasses.replace(plan, preempted=tuple(preempted))

    def _schedule_once(self, admit: bool) -> BatchPlan:
        budget = self.token_budget
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        preempted: list[str] = []
        scheduled: set[int] = set()

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or not req.is_decode:
                continue
            while not self._grow(req, req.num_computed + 1):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            decodes.append(ScheduledChunk(req.request_id, req.num_computed, 1, True))
            scheduled.add(id(req))
            budget -= 1

        candidates = [r for r in self.running if id(r) not in scheduled and not r.is_decode]
        for req in candidates:
            if budget == 0 or len(prefills) == self.max_prefill_seqs:
                break
            chunk = self._fits(req, min(req.num_uncomputed, budget))
            if chunk == 0 or not self._grow(req, req.num_computed + chunk):
                continue
            prefills.append(self._chunk(req, chunk))
            budget -= chunk

        # No admissions in a step that had to preempt: memory is short, and readmitting the
        # victim at once would only thrash.
        while (admit and not preempted and self.waiting and budget > 0
               and len(prefills) < self.max_prefill_seqs
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            chunk = self._fits(req, min(req.num_uncomputed, budget))
            if chunk == 0 or not self._grow(req, chunk):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            prefills.append(self._chunk(req, chunk))
            budget -= chunk

        return BatchPlan(tuple(decodes), tuple(prefills), tuple(preempted))

    @staticmethod
    def _chunk(req: Request, n: int) -> ScheduledChunk:
        return ScheduledChunk(req.request_id, req.num_computed, n,
                              req.num_computed + n == len(req.token_ids))

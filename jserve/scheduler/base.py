"""What every policy shares: the waiting and running queues, KV pages (grow, release,
recompute preemption), retiring requests, and a guard against running prefills deadlocked on
memory. Pure Python, so the simulator drives the same objects as the live engine.

One iteration is ``plan = schedule()``, the step runs, ``update(plan, sampled)``. Between the
two the plan is in flight: its chunks count as computed (so a stream pipeline can take a
prefill's next chunk before this one's results are back), its requests are pinned (never
preempted; a finish defers freeing their pages) and those awaiting a sampled token are held
out of scheduling. With one plan in flight at a time this is the plain engine step; a
pipeline keeps up to ``spp`` in flight and updates them in launch order. Async scheduling
lifts a hold early (``sampled_on_device``): the request gets a ``PLACEHOLDER`` token and may
decode again before the host has read its token.

Preemption frees a victim's pages either by recompute (its KV is dropped and rebuilt by
prefilling again) or by swap (the engine copies its KV to host memory and back when it is
readmitted); ``swap_policy`` (jserve.scheduler.swap) picks per victim, recompute when None.

With a sliding window (``allocator.window``) a running request gives back the pages its next
chunk's first query no longer reads each time it is scheduled (``_drop_dead``); a claim on a
cached prefix takes only its live pages, a swap moves only the held ones back to the same
positions (docs/prefix_cache.md, "Sliding-window models")."""
from __future__ import annotations

import abc
import collections
import dataclasses
from typing import Callable, Sequence

from jserve.cache.allocator import FREED_PAGE, PageAllocator
from jserve.cache.prefix import extend_page_keys
from jserve.scheduler import drafts
from jserve.scheduler.host_prefix import claim_host, host_prefix, restore, unclaim_host
from jserve.scheduler.plan import BatchPlan, PageMove, ScheduledChunk
from jserve.scheduler.request import PLACEHOLDER, Request, RequestStatus
from jserve.scheduler.swap import SwapPolicy


def _no_copy(num_pages: int) -> float:
    """No host tier: nothing to restore."""
    return 0.0


@dataclasses.dataclass(eq=False)
class _Outstanding:
    """A plan between ``schedule`` and ``update``: its chunks' requests, and those whose
    sampled token is still held (not yet handed on by ``sampled_on_device``)."""

    plan: BatchPlan
    requests: list[Request]
    held: set[Request]


class SchedulerBase(abc.ABC):
    def __init__(self, allocator: PageAllocator, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_prefill_seqs: int):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.max_prefill_seqs = max_prefill_seqs
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.num_swaps = 0
        self.swap_policy: SwapPolicy | None = None
        self._swap_out: list[PageMove] = []
        self._swap_in: list[PageMove] = []
        # Plans scheduled and not yet updated, oldest first.
        self._launched: collections.deque[_Outstanding] = collections.deque()
        # Requests whose sampled token is in flight: they may not decode or be preempted until
        # ``update`` brings it.
        self.in_flight: set[Request] = set()
        # Requests with chunks in flight (count of them): those chunks may still write KV
        # into the request's pages, so it is never preempted and a finish defers freeing its
        # pages (``_deferred``) until its last chunk is updated.
        self.pinned: dict[Request, int] = {}
        self._deferred: dict[Request, list[int]] = {}
        # Prefix cache counters: prompt tokens looked up at admission, and found cached.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        # Of the hits, tokens restored from the host tier; and what restoring n pages costs
        # in seconds (the engine's learned copy rate, the simulator's link): the deadline
        # policies price a waiting request by it (``Request.restore_hint``).
        self.prefix_host_hit_tokens = 0
        self.restore_seconds: Callable[[int], float] = _no_copy
        # Speculative decoding counters: draft tokens verified, accepted, and the
        # speculating decodes that verified them.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_draft_steps = 0
        # Speculative decoding: called with the scheduler at the start of ``schedule()``;
        # sets ``draft_ids`` of running requests (jserve.speculative).
        self.proposer = None
        # LoRA: the device's adapter slots (``jserve.lora.slots.AdapterSlots``; None: no
        # adapters served). A request is admitted only with its adapter's slot.
        self.adapters = None

    # -- queue management --------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self._peek_prefix(req)
        self.waiting.append(req)

    def update(self, plan: BatchPlan, sampled: Sequence[int] | None
               ) -> list[tuple[int, Request]]:
        """Takes back the oldest plan in flight once its step has run: the KV of its chunks
        exists (full pages become findable in the prefix cache), pins and holds are lifted,
        and the token ``sampled[i]`` of its i-th sampling chunk (decodes, then prefills) is
        appended to that request if it is still live. ``sampled=None``: the step failed, so
        nothing is registered or appended (the caller finishes the requests). Returns
        (i, request) for each token appended; deciding whether a request stops is the
        caller's (stop tokens and strings are output processing)."""
        entry = self._launched.popleft()
        if entry.plan is not plan:
            raise RuntimeError("update() takes plans back in the order schedule() gave them")
        appended = []
        i = 0
        for req, c in zip(entry.requests, plan.decodes + plan.prefills):
            self._unpin(req)
            live = sampled is not None and not req.status.finished
            if c.drafts:
                if req in entry.held:
                    self.in_flight.discard(req)
                if live:
                    appended += drafts.verify(self, req, c, sampled, i)
                i += 1 + len(c.drafts)
                continue
            end = c.start + c.num_tokens
            if c.samples:
                if req in entry.held:
                    self.in_flight.discard(req)
                for j in range(plan.burst) if live else ():
                    if end + j < len(req.all_token_ids):  # its placeholder (async scheduling)
                        req.all_token_ids[end + j] = sampled[i + j]
                    else:
                        req.all_token_ids.append(sampled[i + j])
                    appended.append((i + j, req))
                i += plan.burst
            if live:  # a burst's KV reaches its last input, a token it sampled itself
                self._register_pages(req, end + plan.burst - 1)
        return appended

    def requests_of(self, plan: BatchPlan) -> list[Request]:
        """The requests of in-flight ``plan``'s chunks (decodes, then prefills), as launched."""
        return next(e.requests for e in reversed(self._launched) if e.plan is plan)

    def sampled_on_device(self, plan: BatchPlan, may_continue) -> None:
        """Async scheduling: ``plan``'s step has sampled its tokens on the device, and the
        host reads them later. Each sampling request for which ``may_continue(req, n)`` holds
        (its ``n`` new tokens, one or a burst's, cannot end it by length) gets a
        ``PLACEHOLDER`` token for each and may be
        scheduled again at once; the others stay held until ``update``. ``plan`` must be
        in flight."""
        entry = next(e for e in self._launched if e.plan is plan)
        # A speculating decode's tokens are verified on the host: it stays held until then.
        held = entry.held
        if plan.num_draft_tokens:
            held = held - {r for r, c in zip(entry.requests, plan.decodes) if c.drafts}
        for req in list(held):
            if not req.status.finished and may_continue(req, plan.burst):
                req.all_token_ids.extend([PLACEHOLDER] * plan.burst)
                entry.held.discard(req)
                self.in_flight.discard(req)

    def advance(self, req: Request, num_tokens: int) -> None:
        """Marks ``num_tokens`` more of ``req``'s tokens computed outside a plan (a test's
        set-up), registering its full pages as ``update`` would."""
        req.num_computed += num_tokens
        self._register_pages(req, req.num_computed)

    def _register_pages(self, req: Request, num_computed: int) -> None:
        """``req``'s first ``num_computed`` tokens have their KV written: its full pages
        among them become findable in the prefix cache."""
        alloc = self.allocator
        if not (alloc.prefix_caching and req.cacheable):
            return
        full = min(num_computed // alloc.page_size, len(req.page_ids))
        if full <= req.num_registered_pages:
            return
        keys = extend_page_keys(req.page_keys, req.all_token_ids, alloc.page_size, full,
                                req.adapter)
        for j in range(max(req.num_registered_pages, req.num_dropped_pages), full):
            alloc.register(req.page_ids[j], keys[j])
        req.num_registered_pages = full

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (done, failed or aborted) and free its pages at once (once its
        last chunk in flight is updated, if it has one)."""
        if self.swap_policy is not None:
            self.swap_policy.release(req.request_id)
        self.in_flight.discard(req)
        self._drop_adapter(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req in self.pinned:
            self._deferred[req] = req.held_page_ids
            req.page_ids = []
            req.num_dropped_pages = 0
        else:
            self._release(req)
        req.status = status

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def page_holders(self) -> list[list[int]]:
        """Every list of pages in use: the running requests' page tables, and those of
        finished requests whose chunks are still in flight (freed when they are back)."""
        return [r.held_page_ids for r in self.running] + list(self._deferred.values())

    def _launch(self, plan: BatchPlan) -> None:
        """``plan`` leaves for the device: its chunks count as computed, its requests are
        pinned, and those that sample are held until ``update``."""
        by_id = {r.request_id: r for r in self.running}  # every chunk's request runs
        reqs = [by_id[c.request_id] for c in plan.decodes + plan.prefills]
        pinned = self.pinned
        held = set()
        extra = plan.burst - 1  # a burst's decodes compute that many more tokens
        for req, c in zip(reqs, plan.decodes + plan.prefills):
            req.num_computed += c.num_tokens + extra
            if c.drafts:  # they stand in the tokens until ``update`` verifies them
                req.all_token_ids.extend(c.drafts)
            pinned[req] = pinned.get(req, 0) + 1
            if c.samples:
                held.add(req)
        self.in_flight |= held
        self._launched.append(_Outstanding(plan, reqs, held))

    def _unpin(self, req: Request) -> None:
        """One chunk of ``req`` is back; the last one frees deferred pages."""
        left = self.pinned.pop(req) - 1
        if left:
            self.pinned[req] = left
        elif req in self._deferred:
            self.allocator.free(self._deferred.pop(req))

    def has_schedulable(self) -> bool:
        """Something a plan could contain: a waiting request or a running one not in flight."""
        return bool(self.waiting) or len(self.running) > len(self.in_flight)

    # -- pages ------------------------------------------------------------------------
    def _release(self, req: Request, keep_dropped: bool = False) -> None:
        """Frees the pages ``req`` holds; ``keep_dropped``: its page list keeps the entries
        of pages a window dropped (a swapped request's KV comes back after them)."""
        self.allocator.free(req.held_page_ids)
        req.num_dropped_pages = req.num_dropped_pages if keep_dropped else 0
        req.page_ids = [FREED_PAGE] * req.num_dropped_pages
        req.num_registered_pages = 0

    def _drop_dead(self, req: Request) -> None:
        """A running request about to be scheduled from ``num_computed`` gives back the
        pages its window has passed (nothing without a window; with two layer groups,
        ``jserve.cache.hybrid``, the windowed layers' halves of them)."""
        if self.allocator.frees_dead:
            req.num_dropped_pages = self.allocator.drop_dead(
                req.page_ids, req.num_dropped_pages, req.num_computed)

    def _cached_prefix(self, req: Request) -> list[int]:
        """Cached pages of ``req``'s leading full pages, leaving at least its last token to
        compute (its logits are needed)."""
        alloc = self.allocator
        if not (alloc.prefix_caching and req.cacheable and req.takes_cached):
            return []
        pages = (len(req.all_token_ids) - 1) // alloc.page_size
        return alloc.lookup(extend_page_keys(req.page_keys, req.all_token_ids, alloc.page_size,
                                             pages, req.adapter))

    def _peek_prefix(self, req: Request) -> None:
        """Record how much of a newly queued request the cache holds (no pages taken), and
        how many of those pages only the host tier holds: the deadline-aware policies rank
        and time a waiting request by its uncached work plus its restore time."""
        if req.num_computed == 0 and not req.swapped:
            device = len(self._cached_prefix(req))
            req.restore_hint = len(host_prefix(self.allocator, req, device))
            req.cached_hint = (device + req.restore_hint) * self.allocator.page_size

    def _claim_prefix(self, req: Request) -> None:
        """Before admitting waiting ``req``: take its cached leading pages, so it starts
        prefilling after them. ``_unclaim_prefix`` undoes it if the admission fails."""
        if req.num_computed or req.page_ids or req.swapped:
            return
        cached = self._cached_prefix(req)
        req.cached_hint = 0
        if cached:
            # With a window only the live pages are taken: the dead ones stay as they are.
            computed = len(cached) * self.allocator.page_size
            dead = self.allocator.dead_pages(computed)
            self.allocator.acquire(cached[dead:])
            req.page_ids = [FREED_PAGE] * dead + cached[dead:]
            req.num_dropped_pages = dead
            req.num_computed = req.num_cached_tokens = computed
            req.num_registered_pages = len(cached)
        claim_host(self.allocator, req, len(cached))

    def _unclaim_prefix(self, req: Request) -> None:
        if req.status is not RequestStatus.RUNNING and req.num_cached_tokens:
            req.cached_hint = req.num_cached_tokens
            unclaim_host(self.allocator, req)
            req.num_computed = req.num_cached_tokens = 0
            self._release(req)  # a restore's fresh pages go back free: never registered

    def _count_prefix(self, req: Request) -> None:
        """Counts an admission's lookup (prompt tokens asked for, found cached)."""
        if self.allocator.prefix_caching and req.cacheable and req.takes_cached:
            self.prefix_queried_tokens += req.num_prompt_tokens
            self.prefix_hit_tokens += req.num_cached_tokens

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make ``req`` own enough pages for ``num_tokens`` KV entries."""
        need = self.allocator.pages_for(num_tokens) - len(req.page_ids)
        if need <= 0:
            return True
        if not self.allocator.can_extend(req.page_ids, need):  # in the groups they go to
            return False
        req.page_ids.extend(self.allocator.extend(req.page_ids, need))
        return True

    def _preempt(self, req: Request) -> None:
        """Free the victim's pages (swapping its KV out or dropping it for recompute) and
        requeue it at the head of the waiting queue."""
        self.running.remove(req)
        self._drop_adapter(req)
        self._drop_dead(req)  # a swap moves only the pages still read
        used, dropped = self.allocator.pages_for(req.num_computed), req.num_dropped_pages
        if req.num_computed and self.swap_policy is not None \
                and self.swap_policy.swaps(req, used - dropped):
            self._swap_out.append((req.request_id, tuple(req.page_ids[dropped:used])))
            req.swapped = True
            self.num_swaps += 1
        else:
            req.num_computed = 0
        self._release(req, keep_dropped=req.swapped)
        req.num_cached_tokens = 0
        self._peek_prefix(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _fits(self, req: Request, max_chunk: int) -> int:
        """Largest chunk <= max_chunk whose KV fits in req's pages plus the free pages of
        the groups it grows into; with kvp groups it also stops at the next group boundary
        (a multiple of the tokens per group), so a chunk's new KV goes to one group."""
        alloc = self.allocator
        capacity = (len(req.page_ids) + alloc.extendable(req.page_ids)) * alloc.page_size
        tokens_per_group = alloc.tokens_per_group
        if tokens_per_group is not None:
            max_chunk = min(max_chunk, tokens_per_group - req.num_computed % tokens_per_group)
        return max(0, min(max_chunk, capacity - req.num_computed))

    def _spans_groups(self, req: Request) -> bool:
        """A "long" prefill for KV-cache parallelism: its prompt spans more than one group
        (at most one such prefill runs per batch)."""
        tokens_per_group = self.allocator.tokens_per_group
        return tokens_per_group is not None and req.num_prompt_tokens > tokens_per_group

    def _continue_prefills(self, candidates, budget: int
                           ) -> tuple[list[ScheduledChunk], int, bool]:
        """Chunks for running requests still prefilling, in ``candidates`` order, under the
        token budget and ``max_prefill_seqs``; at most one group-spanning prefill (kvp).
        Returns (chunks, budget left, whether a spanning prefill is among them)."""
        prefills: list[ScheduledChunk] = []
        spanning = False
        for req in candidates:
            if budget == 0 or len(prefills) == self.max_prefill_seqs:
                break
            spans = self._spans_groups(req)
            if spans and spanning:
                continue
            self._drop_dead(req)
            chunk = self._fits(req, min(req.num_uncomputed, budget))
            if chunk == 0 or not self._grow(req, req.num_computed + chunk):
                continue
            prefills.append(self._chunk(req, chunk))
            budget -= chunk
            spanning |= spans
        return prefills, budget, spanning

    def _admit_first_chunk(self, req: Request, budget: int) -> ScheduledChunk | None:
        """Admit waiting ``req`` (after its cached prefix) with the largest first chunk that
        fits ``budget`` and the pool; None (nothing changed) when none does."""
        if not self._take_adapter(req):
            return None
        self._claim_prefix(req)
        chunk = self._fits(req, min(req.num_uncomputed, budget))
        if chunk == 0 or not self._grow(req, req.num_computed + chunk):
            self._unclaim_prefix(req)
            self._drop_adapter(req)
            return None
        self._admit(req)
        return self._chunk(req, chunk)

    def _take_adapter(self, req: Request) -> bool:
        """``req``'s adapter slot for its admission (True without one); False: it waits."""
        if req.holds_adapter or req.adapter is None or self.adapters is None:
            return True
        req.holds_adapter = self.adapters.acquire(req.adapter)
        return req.holds_adapter

    def _adapter_blocked(self, req: Request) -> bool:
        """``req`` could not take its adapter's slot now (every slot held by others)."""
        return (req.adapter is not None and self.adapters is not None
                and not req.holds_adapter and not self.adapters.can_acquire(req.adapter))

    def _drop_adapter(self, req: Request) -> None:
        if req.holds_adapter:
            self.adapters.release(req.adapter)
            req.holds_adapter = False

    def _victim(self) -> Request:
        """The running request to preempt under memory pressure (policies override)."""
        return self.running[-1]

    def _pick_victim(self) -> Request | None:
        """``_victim`` among the running requests that are not pinned; None if all are."""
        if not self.pinned:
            return self._victim()
        full = self.running
        self.running = [r for r in full if r not in self.pinned]
        try:
            return self._victim() if self.running else None
        finally:
            self.running = full

    def _schedule_decodes(self, max_decodes: int) -> tuple[list[ScheduledChunk], list[str]]:
        """Every running decode (up to ``max_decodes``), each with a KV slot for its token;
        when the pool is short, victims are preempted until it fits (possibly itself)."""
        decodes: list[ScheduledChunk] = []
        preempted: list[str] = []
        page_size = self.allocator.page_size
        running = RequestStatus.RUNNING
        windowed = self.allocator.frees_dead
        for req in list(self.running):
            if len(decodes) == max_decodes:
                break
            n = len(req.all_token_ids)  # is_decode, inlined: this loop runs for every decode
            if (req.status is not running or n - req.num_computed != 1
                    or n == len(req.prompt_token_ids)):
                continue
            if windowed:
                self._drop_dead(req)
            if n > len(req.page_ids) * page_size:  # its token needs a new page
                while not self._grow(req, n):
                    victim = self._pick_victim()
                    if victim is None:  # every candidate is pinned: the decode waits
                        break
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is req:
                        break
                    # A victim may be a decode this loop already scheduled.
                    decodes = [c for c in decodes if c.request_id != victim.request_id]
                if n > len(req.page_ids) * page_size:
                    continue
            if req.status is running:
                decodes.append(ScheduledChunk(req.request_id, req.num_computed, 1, True))
        return decodes, preempted

    def _admit(self, req: Request) -> None:
        """Callers have grown ``req`` to hold its computed KV plus its first chunk; a swapped
        request's KV goes back into the leading pages."""
        self.waiting.remove(req)
        if req.swapped:
            used = self.allocator.pages_for(req.num_computed)
            self._swap_in.append((req.request_id,
                                  tuple(req.page_ids[req.num_dropped_pages:used])))
            if self.swap_policy is not None:
                self.swap_policy.release(req.request_id)
            req.swapped = False
        req.status = RequestStatus.RUNNING
        self._count_prefix(req)
        self.prefix_host_hit_tokens += restore(self.allocator, req)
        self.running.append(req)

    # -- speculative decoding ------------------------------------------------------------
    def _drafts_fit(self, plan: BatchPlan) -> bool:
        """Whether ``plan`` with its drafts fits the iteration (the token budget is already
        held; the deadline policies also check their time budget)."""
        return True

    @staticmethod
    def _chunk(req: Request, n: int) -> ScheduledChunk:
        return ScheduledChunk(req.request_id, req.num_computed, n,
                              req.num_computed + n == len(req.all_token_ids))

    # -- the policy --------------------------------------------------------------------
    @abc.abstractmethod
    def _schedule_once(self, admit: bool) -> BatchPlan:
        """One batch under the policy; ``admit`` False forbids taking waiting requests."""

    def schedule(self, burst: int = 1, may_burst=None) -> BatchPlan:
        """The next batch, now in flight until ``update`` takes it back. Requests holding a
        sampled token in flight are out of the running queue while the policy plans (so none
        schedules or preempts them) and go back at their places in admission order after it,
        with new admissions after them. ``burst`` > 1: the plan becomes a burst of up to that
        many decode steps (``_as_burst``): the most ``n`` for which ``may_burst(request, n)``
        holds for all of it."""
        if self.proposer is not None:
            self.proposer(self)
        plan = self._schedule_around_in_flight()
        if burst > 1:
            plan = self._as_burst(plan, burst, may_burst)
        if self.allocator.host is not None:  # the host tier's copies go with the plan
            offload, restores = self.allocator.host.take_moves()
            if offload or restores:
                plan = dataclasses.replace(plan, offload=offload, restore=restores)
        if not plan.is_empty:
            self._launch(plan)
        return plan

    def _as_burst(self, plan: BatchPlan, burst: int, may_burst) -> BatchPlan:
        """``plan`` as a burst of up to ``burst`` decode steps when it decodes every running
        request and nothing else (no prefill, draft, preemption or swap, nobody waiting):
        the most steps, from ``burst`` down to 2, that every request may take without the
        host in between (``may_burst``: a request near its ``max_tokens`` or the context
        shortens the burst; one that may take none prevents it), once the pages of all of
        them grow to hold those; else ``plan`` unchanged, and so are their pages."""
        if (self.waiting or plan.prefills or not plan.decodes or plan.num_draft_tokens
                or plan.preempted or plan.swap_out or plan.swap_in
                or len(plan.decodes) != len(self.running)):
            return plan
        by_id = {r.request_id: r for r in self.running}
        reqs = [by_id.get(c.request_id) for c in plan.decodes]
        for r in reqs:  # one pass: ``may_burst`` holds for fewer steps where it holds for more
            while burst > 1 and (r is None or not may_burst(r, burst)):
                burst -= 1
            if burst == 1:
                return plan
        had = [len(r.page_ids) for r in reqs]
        if all(self._grow(r, c.start + burst) for r, c in zip(reqs, plan.decodes)):
            return dataclasses.replace(plan, burst=burst)
        for r, n in zip(reqs, had):  # the pool is short: what was grown goes back
            self.allocator.free(r.page_ids[n:])
            del r.page_ids[n:]
        return plan

    def _schedule_around_in_flight(self) -> BatchPlan:
        if not self.in_flight:
            return self._schedule()
        before = self.running
        self.running = [r for r in before if r not in self.in_flight]
        self.max_num_seqs -= len(self.in_flight)  # they still count against the cap
        try:
            return self._schedule()
        finally:
            self.max_num_seqs += len(self.in_flight)
            after = self.running
            kept, old = set(after), set(before)
            self.running = ([r for r in before if r in self.in_flight or r in kept]
                            + [r for r in after if r not in old])

    def _schedule(self) -> BatchPlan:
        plan = self._schedule_once(admit=True)
        preempted = list(plan.preempted)
        while plan.is_empty and self.running:
            # Running prefills hold pages none of them can grow into: free the newest.
            victim = self._pick_victim()
            if victim is None:  # all pinned: their chunks leave the pipeline first
                break
            self._preempt(victim)
            preempted.append(victim.request_id)
            plan = self._schedule_once(admit=False)
            preempted.extend(plan.preempted)
        plan = drafts.with_drafts(self, plan)
        swap_out, swap_in = tuple(self._swap_out), tuple(self._swap_in)
        self._swap_out.clear()
        self._swap_in.clear()
        return dataclasses.replace(plan, preempted=tuple(preempted), swap_out=swap_out,
                                   swap_in=swap_in)

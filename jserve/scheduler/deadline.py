"""Deadline-aware preemptive policies with adaptive chunking (Medha Algorithms 1 and 2).

Every iteration: all running decodes first; then prefills in policy order, each getting the
largest chunk (binary search, granularity 32) whose predicted batch time still fits the
iteration budget ``t_target``. With space sharing a long prefill (KV processed >= a
threshold) with relative slack rho uses only (1 - min(max(rho, 0), rho_max)) of the budget
left, so short prefills fit beside it, and at most one long prefill runs per batch.

Policies order prefills by a key (lower first): ``edf`` the TTFT deadline; ``lrs`` the
remaining slack (deadline - now - remaining isolated prefill time); ``lars`` the slack relative
to the request's length: by default over its remaining isolated prefill time; the variants
``total_work`` (over the total isolated prefill time, the paper's wording) and
``relative_deadline`` (over deadline - arrival, as Medha's public code does) are switches.
Only the default meets the paper's constructed case (docs/scheduler.md has the arithmetic).
``lars`` also ranks *due* requests (slack in [0, t_target)) first, least remaining work first,
before late ones (negative slack, the paper's order among them) and the rest
(``DeadlineConfig.due_first``; docs/scheduler.md, "Due requests"). Remaining work includes the
prefill-time cache's ``drain_s`` (a pipeline's last pass).
``fcfs`` is the non-preemptive convoy baseline: prefills in arrival order, one at a time, each
run to completion at the token cap before the next starts.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from jserve.cache.allocator import PageAllocator
from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.chunking import ChunkSearch, PrefillTimeCache
from jserve.scheduler.plan import BatchPlan, with_chunk
from jserve.scheduler.predictor import RuntimePredictor
from jserve.scheduler.request import Request, RequestStatus

DEADLINE_POLICIES = ("fcfs", "edf", "lrs", "lars")
LARS_VARIANTS = ("total_work", "relative_deadline", "remaining_work")


@dataclasses.dataclass(frozen=True)
class DeadlineConfig:
    t_target: float = 0.05           # iteration time budget (seconds), from the TPOT SLO
    ttft_k: float = 1.5              # TTFT deadline = max(k x isolated prefill, floor)
    ttft_floor: float = 0.5
    chunk_granularity: int = 32
    space_sharing: bool = True
    rho_max: float = 0.5             # the paper's text says 0.4
    long_threshold: int = 32768      # KV already processed that makes a prefill "long"
    lars_variant: str = "remaining_work"  # see LARS_VARIANTS and docs/scheduler.md
    # lars: a request that can still meet its deadline but has less than one iteration budget
    # (t_target) of slack left is due: due requests rank before all others, least remaining
    # work first (docs/scheduler.md, "Due requests"). False: the paper's order, where a late
    # request's negative key ranks it before them and makes them late too.
    due_first: bool = True
    # lars with due_first: a request whose remaining work fits in this multiple of t_target
    # also ranks with the due ones (least work first), however much slack it has (or however
    # late it is): a short prompt is served at once instead of when its slack runs out, and a
    # cheap late one does not wait behind a costly due one. 0: off.
    quick_first: float = 4.0
    # The progress rule (docs/server.md): a running request's ``tpot_slo`` may shorten the
    # iteration below ``t_target``, but never below the predicted time of the iteration's
    # decodes plus this share of ``t_target``, so prefills keep at least
    # min(prefill_share x t_target, what they get with no tpot_slo at all) of every
    # iteration, whatever SLO a client asks for.
    prefill_share: float = 0.75
    # With no decode in the batch there is no one for t_target to protect: the first prefill
    # in policy order runs a whole chunk (the token budget) instead of one cut to t_target,
    # which at long context pays a step's fixed costs for a few tokens at a time. Others
    # wait for the next iteration (they rank after it; a quick-first short ranks before).
    # The live engine turns it on (EngineConfig.full_chunk_alone); off, the paper's adaptive
    # chunks always (the simulator's large token budget would hold arrivals for seconds).
    full_chunk_alone: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.prefill_share <= 1.0:
            raise ValueError(f"prefill_share must be in [0, 1], got {self.prefill_share}")
        if self.lars_variant not in LARS_VARIANTS:
            raise ValueError(f"lars_variant must be one of {LARS_VARIANTS}, "
                             f"got {self.lars_variant!r}")


class DeadlineScheduler(SchedulerBase):
    def __init__(self, allocator: PageAllocator, *, policy: str, predictor: RuntimePredictor,
                 prefill_cache: PrefillTimeCache, max_num_seqs: int,
                 max_num_batched_tokens: int, max_prefill_seqs: int,
                 config: DeadlineConfig = DeadlineConfig(),
                 clock: Callable[[], float] = time.monotonic):
        if policy not in DEADLINE_POLICIES:
            raise ValueError(f"policy must be one of {DEADLINE_POLICIES}, got {policy!r}")
        super().__init__(allocator, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_prefill_seqs=max_prefill_seqs)
        self.policy = policy
        self.predictor = predictor
        self.cache = prefill_cache
        self.config = config
        self.clock = clock
        self._priorities = self._tpot_slos = False
        self._queued = _QueuedParts()  # key parts of waiting requests (``_parts``)

    # -- deadlines and slack -----------------------------------------------------------
    # Each quantity is computed for a list of requests at once, as float64 arrays (the whole
    # waiting queue is keyed every step); the one-request methods wrap the arrays. A
    # request's key parts (deadline, arrival, remaining and total isolated prefill time,
    # priority: ``_parts``) stay fixed while it waits, so ``_queued`` keeps them from when it
    # entered the queue, and a step reads them for 1,000 waiting requests as numpy gathers
    # rather than as attribute reads of every request. numpy's elementwise arithmetic is
    # Python's, so cached and fresh keys are the same floats.
    def add(self, req: Request) -> None:
        # Per-request priorities and TPOT SLOs are rare: their columns are read only once
        # some request has brought one.
        self._priorities |= req.priority != 0
        self._tpot_slos |= req.tpot_slo is not None
        super().add(req)  # records the cached prefix, which shortens the isolated prefill
        if req.ttft_deadline is None:
            isolated = (self.cache.remaining(req.num_prompt_tokens, req.cached_hint)
                        + self.restore_seconds(req.restore_hint))
            req.ttft_deadline = req.arrival_time + max(self.config.ttft_k * isolated,
                                                       self.config.ttft_floor)
        self._queued.put(req, self._queued_parts(req), self.waiting)

    def _preempt(self, req: Request) -> None:
        super()._preempt(req)  # back at the queue's head, with less done, maybe more tokens
        self._queued.put(req, self._queued_parts(req), self.waiting, at_head=True)

    def _admit(self, req: Request) -> None:
        super()._admit(req)
        self._queued.drop(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        super().finish(req, status)
        self._queued.drop(req)

    def remaining_work(self, req: Request) -> float:
        return float(self._columns([req])[_WORK, 0])

    def slack(self, req: Request, now: float) -> float:
        return float(_slacks(self._columns([req]), now)[0])

    def relative_slack(self, req: Request, now: float) -> float:
        """Slack over the request's total isolated prefill time."""
        cols = self._columns([req])
        return float(_ratios(_slacks(cols, now), cols[_TOTAL])[0])

    def key(self, req: Request, now: float) -> float:
        return float(self._keys([req], now)[0])

    def _parts(self, req: Request) -> tuple[float, float, float, float, float]:
        """(deadline, arrival, remaining isolated prefill time, total isolated prefill time,
        priority): all a policy's key reads of a request, from its state now (no deadline
        yet: NaN, which only fcfs, keyed by arrival, may meet). A waiting request's remaining
        work is its uncached prefill plus the copy of its host-tier pages back."""
        total, deadline = self.cache.lookup(len(req.all_token_ids)), req.ttft_deadline
        work = total - self.cache.lookup(req.num_done)
        if work > 0:  # a pipeline's last pass (``drain_s``), owed while any prompt is left
            work += self.cache.drain_s
        if req.restore_hint and not req.num_computed:  # pages to copy back from the host
            work += self.restore_seconds(req.restore_hint)
        if req.adapter is not None and self.adapters is not None and not req.holds_adapter:
            work += self.adapters.load_cost(req.adapter)  # its adapter's copy to the device
        return (math.nan if deadline is None else deadline, req.arrival_time, work, total,
                req.priority)

    def _columns(self, reqs: Sequence[Request]) -> np.ndarray:
        """``_parts`` of ``reqs`` as rows of columns (shape (5, len(reqs))), computed now."""
        return np.fromiter(itertools.chain.from_iterable(map(self._parts, reqs)), np.float64,
                           5 * len(reqs)).reshape(-1, 5).T

    def _queued_parts(self, req: Request) -> tuple[float, ...]:
        """What ``_queued`` keeps of a waiting request: its ``_parts``, then what decides
        whether the loop may pass it over once hopeless (``_schedule_once``): its uncomputed
        tokens, its KV past its pages (to hold a chunk the free pages must hold this plus
        the chunk), and whether claiming and unclaiming its prefix would change nothing (no
        cached pages held, none to look up)."""
        computed, pages = req.num_computed, req.page_ids
        plain = not req.num_cached_tokens and bool(
            computed or pages or req.swapped  # ``_claim_prefix`` returns at once
            or req.cached_hint == 0 and not (self.allocator.prefix_caching and req.cacheable
                                             and req.takes_cached))
        return self._parts(req) + (len(req.all_token_ids) - computed,
                                   computed - len(pages) * self.allocator.page_size, plain)

    def _keys(self, reqs: Sequence[Request], now: float) -> np.ndarray:
        """The policy's order (lower first) of each request at ``now``."""
        return self._keys_of(self._columns(reqs), now)

    def _keys_of(self, cols: np.ndarray, now: float) -> np.ndarray:
        """The policy's keys from ``_parts`` columns."""
        if self.policy == "fcfs":
            return cols[_ARRIVAL]
        if self.policy == "edf":
            return cols[_DEADLINE]
        slack = _slacks(cols, now)
        if self.policy == "lrs":
            return slack
        if self.config.lars_variant == "relative_deadline":
            keys = _ratios(slack, cols[_DEADLINE] - cols[_ARRIVAL])
        elif self.config.lars_variant == "remaining_work":
            keys = _ratios(slack, cols[_WORK])
        else:
            keys = _ratios(slack, cols[_TOTAL])
        if self.config.due_first:
            keys = _due_first(keys, slack, cols[_WORK], self.config.t_target,
                              self.config.quick_first)
        return keys

    @property
    def pack_s(self) -> float:
        """Isolated prefill time up to which a prompt is short enough to be finished whole in
        one iteration past the iteration budget (``_whole``; a long prompt's last part is
        not): ``quick_first`` x ``t_target`` under every deadline policy; 0 for fcfs, which
        never preempts, or with quick_first 0."""
        return 0.0 if self.policy == "fcfs" else self.config.quick_first * self.config.t_target

    def _whole(self, req: Request, cap: int, search: ChunkSearch, until: float,
               now: float) -> int:
        """For a short prompt (``pack_s``) that the budget left beside the plan cannot give a
        first chunk: all of its remainder, however far past the budget, when the iteration
        with it still ends by ``until`` (``_until``); else 0. Where a step's fixed cost and
        the decodes beside it leave no room in the budget (a CPU), short prompts are then
        served several to a step, not one per iteration (or none while anything decodes),
        and none is made to miss a deadline it would have met."""
        n = req.num_uncomputed
        if n > cap:
            return 0
        return n if now + search.time(req.request_id, req.num_computed, n, True) <= until \
            else 0

    @staticmethod
    def _until(req: Request, search: ChunkSearch, until: float, now: float) -> float:
        """``until`` once the plan of ``search`` completes ``req``'s prompt: its TTFT deadline
        too when that plan still meets it (a late one is not delayed further by what joins)."""
        deadline = req.ttft_deadline
        if deadline is None or deadline >= until:
            return until
        return until if now + search.plan_time > deadline else deadline

    def _shared_budget(self, req: Request, search: ChunkSearch, t_target: float,
                       now: float) -> float:
        """What of the budget a long prefill may use beside the plan of ``search``: with
        space sharing, the time left shrunk by its relative slack, so short prefills fit
        beside it."""
        if not (self._is_long(req) and self.config.space_sharing):
            return t_target
        used = search.plan_time
        share = 1.0 - min(max(self.relative_slack(req, now), 0.0), self.config.rho_max)
        return used + (t_target - used) * share

    @property
    def quick_s(self) -> float:
        """lars's due-first class bound: remaining work under it goes first when due
        (``DeadlineConfig.quick_first`` x ``t_target``); 0 when the order has no such class."""
        return self.pack_s if self.policy == "lars" and self.config.due_first else 0.0

    def _victim(self) -> Request:
        keys = self._keys(self.running, self.clock()).tolist()
        running = self.running
        return running[max(range(len(keys)), key=lambda i: (
            running[i].priority, keys[i], running[i].arrival_time))]

    def _is_long(self, req: Request) -> bool:
        return req.num_computed >= self.config.long_threshold

    def _candidates(self, now: float, admit: bool, scheduled: set[str]
                    ) -> tuple[list[Request], set[Request], np.ndarray]:
        """Running prefills and the ``room`` most urgent waiting requests, in policy order
        (ties: earlier arrival, then running before waiting, then queue order); which of
        them are waiting; and for each, what ``_queued_parts`` adds to the key parts (zeros
        for a running one) and its total isolated prefill time. The waiting requests are
        keyed from the parts cached when they were queued, and only the ``room`` most urgent
        of them are read."""
        reqs = [r for r in self.running if r.request_id not in scheduled and not r.is_decode]
        num_running, room = len(reqs), self.max_num_seqs - len(self.running)
        cols = self._columns(reqs)
        queued = self._queued
        if admit and room > 0 and self.waiting:
            if not queued.in_sync(self.waiting):
                queued.rebuild(self.waiting, self._queued_parts)
            n, table = queued.n, queued.table
            if room < n:  # the room most urgent (ties: queue order) are all that is read
                cols = np.concatenate([cols, table[:_SEQ, :n]], 1)
                keys = self._keys_of(cols, now)
                ranks = (table[_SEQ, :n], keys[num_running:])
                if self._priorities:
                    ranks += (cols[_PRIORITY, num_running:],)
                chosen = np.lexsort(ranks)[:room]
                keep = np.concatenate([np.arange(num_running), chosen + num_running])
                cols, keys = cols[:, keep], keys[keep]
            else:  # all of them, in queue order
                chosen = np.argsort(table[_SEQ, :n])
                cols = np.concatenate([cols, table[:_SEQ, chosen]], 1)
                keys = self._keys_of(cols, now)
            reqs += map(queued.reqs.__getitem__, chosen.tolist())
            extra = np.concatenate([np.zeros((3, num_running)), table[_SEQ + 1:, chosen]], 1)
        else:
            keys = self._keys_of(cols, now)
            extra = np.zeros((3, num_running))
        extra = np.concatenate([extra, cols[_TOTAL][None]])
        # Ties: earlier arrival (unless priorities are in play), then their order here
        # (running first, then waiting by urgency: by queue order among equal keys).
        order = np.lexsort((keys, cols[_PRIORITY]) if self._priorities
                           else (cols[_ARRIVAL], keys))
        return [reqs[i] for i in order.tolist()], set(reqs[num_running:]), extra[:, order]

    # -- the batch ---------------------------------------------------------------------
    def iteration_budget(self, decodes: BatchPlan) -> float:
        """The time budget of an iteration running ``decodes``: ``t_target``, lowered to the
        tightest ``tpot_slo`` among running requests, but never below the decodes' predicted
        time plus ``prefill_share`` of ``t_target`` (the progress rule: one client's SLO
        cannot stop every other request's prefill)."""
        base = self.config.t_target
        if not self._tpot_slos:
            return base
        tightest = min([base] + [r.tpot_slo for r in self.running if r.tpot_slo])
        if tightest >= base:
            return base
        floor = self.predictor.predict(decodes) + self.config.prefill_share * base
        return min(base, max(tightest, floor))

    def _drafts_fit(self, plan: BatchPlan) -> bool:
        """Drafts cost time like any tokens: a plan with them must stay within the budget of
        the same iteration without them (short budgets shrink or drop k)."""
        plain = BatchPlan(tuple(c._replace(num_tokens=1, drafts=()) if c.drafts else c
                                for c in plan.decodes), ())
        return self.predictor.predict(plan) <= self.iteration_budget(plain)

    def _passes_over(self, req: Request, free: int) -> bool:
        """Whether a running candidate is sure to be skipped once not even a first granule
        fits (``hopeless``): its chunk cap (the loop's ``_fits``, with one KV group of
        ``free`` free pages) is at least a granule. (``_unclaim_prefix`` passes a running
        request over.) Waiting candidates are decided from ``_queued_parts``."""
        g, computed = self.config.chunk_granularity, req.num_computed
        return len(req.all_token_ids) - computed >= g \
            and (len(req.page_ids) + free) * self.allocator.page_size - computed >= g

    def _unclaim(self, req: Request, queued: bool, hint: int) -> None:
        """A waiting request that was not admitted gives its claimed prefix back; its
        cached-prefix hint then reflects the cache now, and its cached parts follow."""
        if queued:
            self._unclaim_prefix(req)
            self._drop_adapter(req)
            if req.cached_hint != hint or req.restore_hint:
                self._queued.update(req, self._queued_parts(req))

    def _schedule_once(self, admit: bool) -> BatchPlan:
        now = self.clock()
        decodes, preempted = self._schedule_decodes(self.max_num_seqs)
        plan = BatchPlan(tuple(decodes), ())
        candidates, waiting, extra = self._candidates(now, admit and not preempted,
                                                      {c.request_id for c in decodes})
        if self.policy == "fcfs":
            candidates = candidates[:1]  # non-preemptive: the oldest prefill runs alone

        granularity, t_target = self.config.chunk_granularity, self.iteration_budget(plan)
        search = ChunkSearch(self.predictor, plan, granularity)
        tokens_left, until = self.token_budget - plan.num_tokens, math.inf  # ``_until``
        quick = (extra[3] <= self.pack_s).tolist() if self.pack_s else [False] * len(extra[3])
        # Set once not even a first granule fits beside ``plan``: until the plan changes,
        # only requests that cannot take a whole granule (short remainders, KV-bound) may fit.
        hopeless = False
        # While hopeless, with one KV group: its free pages, and which waiting candidates
        # are sure to be skipped (cap of a granule or more, a claim would change nothing), so
        # most of the candidates are passed over without claiming, fitting and unclaiming.
        free, passable = 0, None
        has_long = has_spanning = False
        for i, req in enumerate(candidates):
            if len(plan.prefills) == self.max_prefill_seqs or tokens_left <= 0:
                break
            queued = req in waiting
            if hopeless and free and tokens_left >= granularity and not quick[i]:
                if passable is None:
                    uncomputed, kv_need, plain, _ = extra
                    passable = ((plain == 1) & (uncomputed >= granularity)
                                & (free * self.allocator.page_size >= kv_need + granularity)
                                ).tolist()
                if passable[i] if queued else self._passes_over(req, free):
                    continue
            hint = req.cached_hint if queued else 0
            if queued and not self._take_adapter(req):
                continue  # every adapter slot is held by other adapters' running requests
            if queued:
                self._claim_prefix(req)  # a cached prefix counts as processed KV
            long = self._is_long(req)
            spans = self._spans_groups(req)  # kvp: at most one group-spanning prefill too
            if (long and has_long) or (spans and has_spanning):
                self._unclaim(req, queued, hint)
                continue
            if not queued:
                self._drop_dead(req)  # a window's dead pages go back before it grows
            cap = self._fits(req, min(req.num_uncomputed, tokens_left))
            if hopeless and cap >= granularity:
                n = self._whole(req, cap, search, until, now) if quick[i] else 0
                if not n:
                    self._unclaim(req, queued, hint)
                    continue
            elif self.policy == "fcfs":
                n = cap
            elif self.config.full_chunk_alone and plan.is_empty:
                n = cap  # no decode to protect: the first in policy order, a whole chunk
            else:
                n = search.largest(req.request_id, req.num_computed, req.num_uncomputed,
                                   self._shared_budget(req, search, t_target, now),
                                   max_chunk=cap)
                if n == 0 and plan.is_empty:
                    n = min(cap, granularity)  # always make progress
                elif n == 0:  # none fits beside ``plan``: a short prompt may, whole
                    n = self._whole(req, cap, search, until, now) if quick[i] else 0
                    if not n and not hopeless:
                        hopeless = search.missed(0, granularity, False, t_target)
                        if hopeless and self.allocator.groups == 1:
                            free, passable = self.allocator.extendable(()), None
            if n <= 0 or not self._grow(req, req.num_computed + n):
                self._unclaim(req, queued, hint)
                continue
            if queued:
                self._admit(req)
            last = req.num_computed + n == len(req.all_token_ids)
            plan = with_chunk(plan, req.request_id, req.num_computed, n, last)
            search, hopeless = ChunkSearch(self.predictor, plan, granularity), False
            until = self._until(req, search, until, now) if last and self.pack_s else until
            tokens_left -= n
            has_long |= long
            has_spanning |= spans
        return dataclasses.replace(plan, preempted=tuple(preempted))


_DEADLINE, _ARRIVAL, _WORK, _TOTAL, _PRIORITY = range(5)  # rows of ``_parts`` columns
_SEQ = 5  # and of ``_QueuedParts.table``: the place in the queue


class _QueuedParts:
    """The waiting queue's ``_parts`` in numpy columns, one slot per request (slots
    ``[0, n)`` are in use, in no particular order), with each request's place in the queue as
    a sequence number (``add`` appends, preemption puts it at the head): a step keys and
    orders the whole queue without reading any request. It follows the queue through the
    scheduler's own methods; a queue changed behind its back is noticed (by its length, its
    ends, and a new request's neighbour) and the table rebuilt from it."""

    def __init__(self) -> None:
        self.n = 0
        self.reqs: list[Request | None] = []      # by slot
        self.slot: dict[Request, int] = {}
        self.table = np.zeros((9, 64))  # ``_parts``, the sequence number, the rest of
        # ``_queued_parts``
        self._seq = [0.0, 0.0]                    # the last given at the head, at the tail
        self._ends: list[Request | None] = [None, None]  # head and tail (None: look it up)
        self._stale = False  # the queue was seen changed behind the table's back

    def put(self, req: Request, parts: tuple[float, ...], queue: collections.deque | None,
            at_head: bool = False) -> None:
        """``req`` entered ``queue`` (at its tail, or its head) with ``parts``."""
        self.drop(req)
        if self.n and queue is not None:  # its neighbour must be the table's end it joins
            self._stale |= len(queue) < 2 or queue[1 if at_head else -2] is not self._end(
                0 if at_head else 1)
        if self.n == self.table.shape[1]:
            self.table = np.concatenate([self.table, np.zeros_like(self.table)], 1)
        end = 0 if at_head else 1
        self._seq[end] += -1.0 if at_head else 1.0
        self.table[:, self.n] = (*parts[:_SEQ], self._seq[end], *parts[_SEQ:])
        self.slot[req] = self.n
        if self.n < len(self.reqs):
            self.reqs[self.n] = req
        else:
            self.reqs.append(req)
        self.n += 1
        self._ends[end] = req
        if self.n == 1:
            self._ends[1 - end] = req

    def update(self, req: Request, parts: tuple[float, ...]) -> None:
        """``req``'s parts changed while it waits; its place did not."""
        slot = self.slot.get(req)
        if slot is not None:
            self.table[:, slot] = (*parts[:_SEQ], self.table[_SEQ, slot], *parts[_SEQ:])

    def drop(self, req: Request) -> None:
        slot = self.slot.pop(req, None)
        if slot is None:
            return
        self.n -= 1
        last = self.n
        if slot != last:  # the last slot moves into the hole
            moved = self.reqs[slot] = self.reqs[last]
            self.table[:, slot] = self.table[:, last]
            self.slot[moved] = slot
        self.reqs[last] = None
        self._ends = [None if r is req else r for r in self._ends]

    def in_sync(self, queue: collections.deque) -> bool:
        """The same length and the same head and tail as ``queue``: a cheap check that the
        queue was not changed other than through the scheduler."""
        n = self.n
        return not self._stale and n == len(queue) and (
            n == 0 or self._end(0) is queue[0] and self._end(1) is queue[-1])

    def _end(self, end: int) -> Request:
        if self._ends[end] is None:
            seq = self.table[_SEQ, :self.n]
            self._ends[end] = self.reqs[int(seq.argmax() if end else seq.argmin())]
        return self._ends[end]

    def rebuild(self, queue: collections.deque, parts: Callable[[Request], tuple]) -> None:
        self.__init__()
        for req in queue:
            self.put(req, parts(req), None)


def _column(values: Iterable[float], n: int) -> np.ndarray:
    """n values as a float64 array; ``map``s of attribute getters run at C speed."""
    return np.fromiter(values, np.float64, n)


def _slacks(cols: np.ndarray, now: float) -> np.ndarray:
    return cols[_DEADLINE] - now - cols[_WORK]


def _due_first(keys: np.ndarray, slack: np.ndarray, work: np.ndarray, margin: float,
               quick: float = 0.0) -> np.ndarray:
    """LARS keys with requests due (0 <= slack < ``margin``) or quick (remaining work at most
    ``quick`` x ``margin``, late or not) first, least remaining work first (keys below -1);
    then late ones (slack < 0) in the paper's order, their negative keys mapped monotonically
    into (-1, 0); then the rest, unchanged (keys >= 0)."""
    late = keys / (1.0 - np.minimum(keys, 0.0))
    keys = np.where(slack < 0, late, keys)
    due = ((slack >= 0) & (slack < margin)) | (work <= quick * margin)
    return np.where(due, -1.0 - 1.0 / np.maximum(work, 1e-9), keys)


def _ratios(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return values / np.maximum(scales, 1e-9)

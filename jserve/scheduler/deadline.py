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

import dataclasses
import operator
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from jserve.cache.allocator import BlockAllocator
from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.chunking import ChunkSearch, PrefillTimeCache, with_chunk
from jserve.scheduler.plan import BatchPlan
from jserve.scheduler.predictor import RuntimePredictor
from jserve.scheduler.request import Request

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

    def __post_init__(self) -> None:
        if self.lars_variant not in LARS_VARIANTS:
            raise ValueError(f"lars_variant must be one of {LARS_VARIANTS}, "
                             f"got {self.lars_variant!r}")


class DeadlineScheduler(SchedulerBase):
    def __init__(self, allocator: BlockAllocator, *, policy: str, predictor: RuntimePredictor,
                 prefill_cache: PrefillTimeCache, max_num_seqs: int,
                 max_num_batched_tokens: int, max_prefill_seqs: int,
                 config: DeadlineConfig = DeadlineConfig(),
                 clock: Callable[[], float] = time.monotonic,
                 priority: Callable[[Request, float], float] | None = None):
        if policy not in DEADLINE_POLICIES and priority is None:
            raise ValueError(f"policy must be one of {DEADLINE_POLICIES}, got {policy!r}")
        super().__init__(allocator, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_prefill_seqs=max_prefill_seqs)
        self.policy = policy
        self.predictor = predictor
        self.cache = prefill_cache
        self.config = config
        self.clock = clock
        self._priority = priority  # the hook an SPRPT-style policy plugs into
        self._priorities = self._tpot_slos = False

    # -- deadlines and slack -----------------------------------------------------------
    # Each quantity is computed for a list of requests at once, as a float64 array (the whole
    # waiting queue is keyed every step; prefill times come from memoized lookups); the
    # one-request methods wrap the arrays. numpy's elementwise arithmetic is Python's.
    def add(self, req: Request) -> None:
        # Per-request priorities and TPOT SLOs are rare: their columns are read only once
        # some request has brought one.
        self._priorities |= req.priority != 0
        self._tpot_slos |= req.tpot_slo is not None
        super().add(req)  # records the cached prefix, which shortens the isolated prefill
        if req.ttft_deadline is None:
            isolated = self.cache.remaining(req.num_prompt_tokens, req.cached_hint)
            req.ttft_deadline = req.arrival_time + max(self.config.ttft_k * isolated,
                                                       self.config.ttft_floor)

    def remaining_work(self, req: Request) -> float:
        return float(self._remaining_works([req])[0])

    def slack(self, req: Request, now: float) -> float:
        return float(self._slacks([req], now)[0])

    def relative_slack(self, req: Request, now: float) -> float:
        """Slack over the request's total isolated prefill time."""
        return float(_ratios(self._slacks([req], now), self._total_works([req]))[0])

    def key(self, req: Request, now: float) -> float:
        return float(self._keys([req], now)[0])

    def _total_works(self, reqs: Sequence[Request]) -> np.ndarray:
        return _column(map(self.cache.lookup, map(len, map(_TOKENS, reqs))), len(reqs))

    def _remaining_works(self, reqs: Sequence[Request]) -> np.ndarray:
        work = self._total_works(reqs) - _column(map(self.cache.lookup, map(_DONE, reqs)),
                                                 len(reqs))
        drain = self.cache.drain_s  # a pipeline's last pass, owed while any prompt is left
        return work + drain * (work > 0) if drain else work

    def _slacks(self, reqs: Sequence[Request], now: float,
                work: np.ndarray | None = None) -> np.ndarray:
        work = self._remaining_works(reqs) if work is None else work
        return _column(map(_DEADLINE, reqs), len(reqs)) - now - work

    def _keys(self, reqs: Sequence[Request], now: float) -> np.ndarray:
        """The policy's order (lower first) of each request at ``now``."""
        if self._priority is not None:
            return _column((self._priority(r, now) for r in reqs), len(reqs))
        if self.policy == "fcfs":
            return _column(map(_ARRIVAL, reqs), len(reqs))
        if self.policy == "edf":
            return _column(map(_DEADLINE, reqs), len(reqs))
        work = self._remaining_works(reqs)
        slack = self._slacks(reqs, now, work)
        if self.policy == "lrs":
            return slack
        if self.config.lars_variant == "relative_deadline":
            keys = _ratios(slack, _column(map(_DEADLINE, reqs), len(reqs))
                           - _column(map(_ARRIVAL, reqs), len(reqs)))
        elif self.config.lars_variant == "remaining_work":
            keys = _ratios(slack, work)
        else:
            keys = _ratios(slack, self._total_works(reqs))
        if self.config.due_first:
            keys = _due_first(keys, slack, work, self.config.t_target)
        return keys

    def _victim(self) -> Request:
        keys = self._keys(self.running, self.clock()).tolist()
        running = self.running
        return running[max(range(len(keys)), key=lambda i: (
            running[i].priority, keys[i], running[i].arrival_time))]

    def _is_long(self, req: Request) -> bool:
        return req.num_computed >= self.config.long_threshold

    def _candidates(self, now: float, admit: bool, scheduled: set[str]
                    ) -> tuple[list[Request], set[Request]]:
        """Running prefills and the ``room`` most urgent waiting requests, in policy order
        (ties: earlier arrival, then running before waiting, then queue order); and which of
        them are waiting. All keys are computed in one pass."""
        reqs = [r for r in self.running if r.request_id not in scheduled and not r.is_decode]
        num_running, room = len(reqs), self.max_num_seqs - len(self.running)
        if admit and room > 0:
            reqs += self.waiting
        keys = self._keys(reqs, now)
        if self._priorities:  # a lower priority value first, then the policy's key
            keys = np.lexsort((keys, _column(map(_PRIORITY, reqs), len(reqs)))).argsort()
        if room < len(reqs) - num_running:  # keep only the room most urgent waiting ones
            urgent = np.argsort(keys[num_running:], kind="stable")[:max(room, 0)]
            keep = np.concatenate([np.arange(num_running), num_running + urgent])
            reqs, keys = [reqs[i] for i in keep.tolist()], keys[keep]
        order = np.lexsort((_column(map(_ARRIVAL, reqs), len(reqs)), keys))  # stable
        return [reqs[i] for i in order.tolist()], set(reqs[num_running:])

    # -- the batch ---------------------------------------------------------------------
    def _schedule_once(self, admit: bool) -> BatchPlan:
        now = self.clock()
        decodes, preempted = self._schedule_decodes(self.max_num_seqs)
        plan = BatchPlan(tuple(decodes), ())
        candidates, waiting = self._candidates(now, admit and not preempted,
                                               {c.request_id for c in decodes})
        if self.policy == "fcfs":
            candidates = candidates[:1]  # non-preemptive: the oldest prefill runs alone

        granularity, t_target = self.config.chunk_granularity, self.config.t_target
        if self._tpot_slos:  # the tightest TPOT SLO among running requests caps the budget
            t_target = min([t_target] + [r.tpot_slo for r in self.running if r.tpot_slo])
        search = ChunkSearch(self.predictor, plan, granularity)
        used = None  # predicted time of ``plan``, when space sharing needs it
        tokens_left = self.token_budget - plan.num_tokens
        # Set once not even a first granule fits beside ``plan``: until the plan changes,
        # only requests that cannot take a whole granule (short remainders, KV-bound) may fit.
        hopeless = False
        has_long = has_spanning = False
        for req in candidates:
            if len(plan.prefills) == self.max_prefill_seqs or tokens_left <= 0:
                break
            if req in waiting:
                self._claim_prefix(req)  # a cached prefix counts as processed KV
            long = self._is_long(req)
            spans = self._spans_groups(req)  # kvp: at most one group-spanning prefill too
            if (long and has_long) or (spans and has_spanning):
                self._unclaim_prefix(req)
                continue
            cap = self._fits(req, min(req.num_uncomputed, tokens_left))
            if hopeless and cap >= granularity:
                self._unclaim_prefix(req)
                continue
            if self.policy == "fcfs":
                n = cap
            else:
                budget = t_target
                if long and self.config.space_sharing:
                    used = self.predictor.predict(plan) if used is None else used
                    rho = self.relative_slack(req, now)
                    share = 1.0 - min(max(rho, 0.0), self.config.rho_max)
                    budget = used + (budget - used) * share
                n = search.largest(req.request_id, req.num_computed, req.num_uncomputed,
                                   budget, max_chunk=cap)
                if n == 0 and plan.is_empty:
                    n = min(cap, granularity)  # always make progress
                elif n == 0 and not hopeless:
                    hopeless = search.missed(0, granularity, False, t_target)
            if n <= 0 or not self._grow(req, req.num_computed + n):
                self._unclaim_prefix(req)
                continue
            if req in waiting:
                self._admit(req)
            plan = with_chunk(plan, req.request_id, req.num_computed, n,
                              req.num_computed + n == len(req.token_ids))
            search, used, hopeless = ChunkSearch(self.predictor, plan, granularity), None, False
            tokens_left -= n
            has_long |= long
            has_spanning |= spans
        return dataclasses.replace(plan, preempted=tuple(preempted))


_ARRIVAL = operator.attrgetter("arrival_time")
_DEADLINE = operator.attrgetter("ttft_deadline")
_PRIORITY = operator.attrgetter("priority")
_TOKENS = operator.attrgetter("token_ids")
_DONE = operator.attrgetter("num_done")  # computed, or found cached for a waiting request


def _column(values: Iterable[float], n: int) -> np.ndarray:
    """n values as a float64 array; ``map``s of attribute getters run at C speed."""
    return np.fromiter(values, np.float64, n)


def _due_first(keys: np.ndarray, slack: np.ndarray, work: np.ndarray, margin: float
               ) -> np.ndarray:
    """LARS keys with requests due (0 <= slack < ``margin``) first, least remaining work
    first (keys below -1); then late ones (slack < 0) in the paper's order, their negative
    keys mapped monotonically into (-1, 0); then the rest, unchanged (keys >= 0)."""
    late = keys / (1.0 - np.minimum(keys, 0.0))
    keys = np.where(slack < 0, late, keys)
    return np.where((slack >= 0) & (slack < margin), -1.0 - 1.0 / np.maximum(work, 1e-9), keys)


def _ratios(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return values / np.maximum(scales, 1e-9)

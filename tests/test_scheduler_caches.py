"""The deadline-aware policies' caches change nothing: waiting requests keyed from the parts
cached when they were queued (``_QueuedParts``) and the cheap pass over hopeless candidates
give the same plans, step by step, as a reference that
keys every request afresh from its fields and orders them with Python's ``sorted``.

Each run drives both schedulers through the same randomized traffic: arrivals over time
(half sharing document prefixes, so the prefix cache hits and claims), swapped and
recomputed preemptions under a small KV pool, aborts of waiting requests, a waiting queue
edited behind the scheduler's back, and priorities.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from jserve.cache.allocator import PageAllocator
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import (
    DEADLINE_POLICIES,
    LARS_VARIANTS,
    DeadlineConfig,
    DeadlineScheduler,
    _QueuedParts,
)
from jserve.scheduler.plan import BatchPlan, ScheduledChunk, with_chunk
from jserve.scheduler.predictor import LinearPredictor
from jserve.scheduler.request import Request, RequestStatus
from jserve.sim import VirtualClock


class Reference(DeadlineScheduler):
    """Every key computed afresh from the request's fields; the order by ``sorted``."""

    def _candidates(self, now, admit, scheduled):
        running = [r for r in self.running if r.request_id not in scheduled and not r.is_decode]
        room = self.max_num_seqs - len(self.running)
        waiting = list(self.waiting) if admit and room > 0 else []
        place = {r: i for i, r in enumerate(running + waiting)}
        key = {r: self.key(r, now) for r in place}  # one request at a time, from its fields
        if self._priorities:
            def urgency(r):
                return r.priority, key[r], place[r]
        else:
            def urgency(r):
                return key[r], place[r]
        if room < len(waiting):
            waiting = sorted(waiting, key=urgency)[:room]
        kept = running + waiting
        if self._priorities:
            order = sorted(kept, key=urgency)
        else:  # stable: ties keep the kept list's order
            order = sorted(kept, key=lambda r: (key[r], r.arrival_time))
        # No waiting candidate passed over unread (``plain`` 0), and no running one; each
        # one's total isolated prefill time from its fields.
        total = [self.cache.lookup(len(r.all_token_ids)) for r in order]
        return order, set(waiting), np.concatenate([np.zeros((3, len(order))), [total]])

    def _passes_over(self, req, free):
        return False  # every candidate goes through claim, fit and unclaim


def drive(cls, seed: int, policy: str, steps: int = 60) -> list[tuple]:
    """The plans (and the waiting queue after each) of ``steps`` steps of seeded traffic."""
    rng = random.Random(seed)
    page = rng.choice([1, 4, 16])
    granularity = rng.choice([8, 16, 32])
    coef = tuple(rng.choice([0.0, rng.uniform(0, s)])
                 for s in (5e-3, 2e-4, 5e-5, 5e-8, 1e-7, 2e-3))
    coef = (coef[0] + 1e-3,) + coef[1:]
    t_target = rng.choice([0.002, 0.005, 0.02, 0.05])
    if rng.random() < 0.4:  # time-bound: a batch holds a few dozen to a few hundred tokens
        coef = (t_target / 10, t_target / rng.choice([48, 200])) + coef[2:]
    predictor = LinearPredictor(coef)
    config = DeadlineConfig(t_target=t_target, chunk_granularity=granularity,
                            space_sharing=rng.random() < 0.7,
                            long_threshold=rng.choice([64, 512, 4096]),
                            lars_variant=rng.choice(LARS_VARIANTS))
    budget = rng.choice([64, 512, 2048])
    cache = PrefillTimeCache(predictor, 8192, t_target, chunk_granularity=granularity,
                             max_chunk=budget)
    groups = 2 if rng.random() < 0.15 else 1
    blocks = rng.choice([12, 24, 64, 256]) * (16 // page) // groups
    alloc = PageAllocator(blocks, page, groups=groups,
                           pages_per_group=(8192 // page) if groups > 1 else None,
                           prefix_caching=rng.random() < 0.5)
    clock = VirtualClock(0.0)
    sched = cls(alloc, policy=policy, predictor=predictor, prefill_cache=cache,
                max_num_seqs=rng.choice([4, 8, 32]), max_num_batched_tokens=budget,
                max_prefill_seqs=rng.choice([1, 2, 4]), config=config, clock=clock)
    if rng.random() < 0.5:
        sched.swap_policy = OddIdsSwap()
    docs = [[rng.randrange(1000) for _ in range(rng.randrange(page, 400))] for _ in range(3)]
    priorities = rng.random() < 0.3
    reqs: dict[str, Request] = {}
    out = []
    for _ in range(steps):
        for _arrival in range(rng.choice([0, 0, 1, 1, 2, 5])):
            prompt = rng.choice(docs) if rng.random() < 0.5 else []
            size = rng.randrange(1, rng.choice([40, 600]))
            prompt = prompt + [rng.randrange(1000) for _ in range(size)]
            req = Request(f"r{len(reqs)}", prompt, rng.randrange(1, 12), clock.now,
                          priority=rng.choice([0, 0, 1, -1]) if priorities else 0)
            req.cacheable = rng.random() < 0.8  # False: penalties, a length probe
            if rng.random() < 0.4:  # on a coarse grid, so deadlines tie across arrivals
                req.ttft_deadline = round(2 * clock.now + rng.uniform(0.02, 2.0)) / 2
            reqs[req.request_id] = req
            sched.add(req)
        if sched.waiting and rng.random() < 0.05:
            sched.finish(rng.choice(list(sched.waiting)), RequestStatus.FINISHED_ABORTED)
        edited = len(sched.waiting) > 1 and rng.random() < 0.03
        if edited:  # behind the scheduler's back
            req = rng.choice(list(sched.waiting))
            sched.waiting.remove(req)
            sched.waiting.append(req)
        plan = sched.schedule()
        out.append((plan, [r.request_id for r in sched.waiting],
                    [(r.request_id, r.cached_hint) for r in sched.waiting], edited))
        apply(plan, reqs, sched)
        clock.now += rng.uniform(0.0, 0.05)
    return out


class OddIdsSwap:
    """A swap policy: requests with odd ids swap, the others recompute."""

    def swaps(self, req: Request, num_pages: int) -> bool:
        return int(req.request_id[1:]) % 2 == 1

    def release(self, request_id: str) -> None:
        pass


def apply(plan: BatchPlan, reqs: dict[str, Request], sched: DeadlineScheduler) -> None:
    """As the engine does: the plan comes back with a token for each sampling chunk, and
    requests at max_tokens are retired."""
    if plan.is_empty:
        return
    sampled = [len(reqs[c.request_id].all_token_ids) % 997
               for c in plan.decodes + plan.prefills if c.samples]
    for _, req in sched.update(plan, sampled):
        if req.num_output_tokens >= req.max_tokens:
            sched.finish(req, RequestStatus.FINISHED_LENGTH)


@pytest.mark.parametrize("policy", DEADLINE_POLICIES)
@pytest.mark.parametrize("seed", range(12))
def test_cached_keys_give_the_reference_plans_step_by_step(policy, seed):
    got, want = drive(DeadlineScheduler, seed, policy), drive(Reference, seed, policy)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"step {step}"
    assert any(p.prefills for p, *_ in got)


def test_the_traffic_preempts_hits_the_cache_and_rebuilds_only_after_outside_edits(
        monkeypatch):
    """The runs above are worth something (some preempt, some hit the prefix cache), and the
    cached parts follow the queue through the scheduler's own changes: they are rebuilt only
    after the queue was edited behind its back."""
    rebuilds = []
    rebuild = _QueuedParts.rebuild
    monkeypatch.setattr(_QueuedParts, "rebuild",
                        lambda self, *a: rebuilds.append(1) or rebuild(self, *a))
    preempted = hits = edits = 0
    for seed in range(12):
        for plan, _, hints, edited in drive(DeadlineScheduler, seed, "lars"):
            preempted += len(plan.preempted)
            hits += any(h for _, h in hints)
            edits += edited
    assert preempted and hits and edits
    assert len(rebuilds) <= edits


class Checked(DeadlineScheduler):
    """Checks after every step that the cached parts are those the requests' fields give."""
    checked = 0

    def schedule(self):
        plan = super().schedule()
        queued = self._queued
        if queued.in_sync(self.waiting):
            for req in self.waiting:
                column = queued.table[:, queued.slot[req]].tolist()
                assert column[:5] + column[6:] == list(self._queued_parts(req)), req
            seqs = [queued.table[5, queued.slot[r]] for r in self.waiting]
            assert seqs == sorted(seqs)  # the queue's order
            Checked.checked += 1
        return plan


def test_queued_parts_are_those_of_the_requests_now_and_in_queue_order():
    for seed in range(24):
        drive(Checked, seed, DEADLINE_POLICIES[seed % len(DEADLINE_POLICIES)])
    assert Checked.checked > 100


def test_with_chunk_keeps_every_other_field_of_the_plan():
    """``with_chunk`` builds the plan directly (cheaper than ``dataclasses.replace``): a field
    added to BatchPlan must be carried there too."""
    plan = BatchPlan((ScheduledChunk("d", 5, 1, True),), (ScheduledChunk("p", 0, 8, False),),
                     preempted=("x",), swap_out=(("x", (1, 2)),), swap_in=(("y", (3,)),))
    chunk = ScheduledChunk("q", 16, 4, True)
    assert with_chunk(plan, *chunk[:4]) == dataclasses.replace(
        plan, prefills=plan.prefills + (chunk,))


def hopeless_case(cls, pages: int, last: str) -> BatchPlan:
    """lars; a batch holds 90 tokens (1e-4 s each, 9 ms budget, granules of 32). W1 (most
    urgent) takes 64, W2 misses even a granule (from then on hopeless), and what comes after
    can take only less than a granule: a running prefill's last 5 tokens, a swapped request
    whose KV leaves room for 20 more in the free pages, or a 20-token prompt."""
    predictor = LinearPredictor((0.0, 1e-4, 0.0, 0.0, 0.0, 0.0))
    # The paper's order (the quick requests of quick_first would jump the queue here).
    config = DeadlineConfig(t_target=0.009, chunk_granularity=32, quick_first=0.0)
    cache = PrefillTimeCache(predictor, 4096, 0.009, chunk_granularity=32, max_chunk=4096)
    sched = cls(PageAllocator(pages + 1, 16), policy="lars", predictor=predictor,
                prefill_cache=cache, max_num_seqs=8, max_num_batched_tokens=4096,
                max_prefill_seqs=4, config=config, clock=VirtualClock(0.0))
    if last == "running":
        r = Request("r", [0] * 100, 1, 0.0, ttft_deadline=100.0)
        sched.add(r)
        r.num_computed = 95
        r.page_ids = sched.allocator.allocate(sched.allocator.pages_for(95))
        sched._admit(r)
    sched.add(Request("w1", [0] * 1000, 1, 0.0, ttft_deadline=0.5))
    sched.add(Request("w2", [0] * 500, 1, 0.0, ttft_deadline=0.6))
    if last == "swapped":
        sched.add(Request("w3", [0] * 300, 1, 0.0, num_computed=140, swapped=True,
                          ttft_deadline=1.0))
    if last == "short":
        sched.add(Request("w3", [0] * 20, 1, 0.0, ttft_deadline=10.0))
    return sched.schedule()


@pytest.mark.parametrize("cls", [DeadlineScheduler, Reference])
def test_once_hopeless_what_fits_in_less_than_a_granule_is_not_passed_over(cls):
    plan = hopeless_case(cls, 64, "running")
    assert [(c.request_id, c.num_tokens) for c in plan.prefills] == [("w1", 64), ("r", 5)]
    plan = hopeless_case(cls, 14, "swapped")
    assert [(c.request_id, c.num_tokens) for c in plan.prefills] == [("w1", 64), ("w3", 20)]
    assert [move[0] for move in plan.swap_in] == ["w3"]  # its KV comes back from the host
    plan = hopeless_case(cls, 64, "short")
    assert [(c.request_id, c.num_tokens) for c in plan.prefills] == [("w1", 64), ("w3", 20)]

"""Sarathi policy decisions on constructed cases (pure Python, no device)."""
from __future__ import annotations

import random

import pytest

from conftest import apply_plan
from jserve.cache.allocator import OutOfPages, PageAllocator
from jserve.scheduler import PLACEHOLDER, Request, RequestStatus, SarathiScheduler
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import DeadlineConfig, DeadlineScheduler
from jserve.scheduler.predictor import LinearPredictor


def _sched(blocks=64, budget=16, seqs=8, prefill_seqs=4, page_size=4):
    return SarathiScheduler(PageAllocator(blocks + 1, page_size), max_num_seqs=seqs,
                            max_num_batched_tokens=budget, max_prefill_seqs=prefill_seqs)


def _req(rid, prompt_len, t, max_tokens=8):
    return Request(rid, list(range(1, prompt_len + 1)), max_tokens, float(t))




def test_decodes_first_then_prefill_chunks_in_arrival_order_under_the_budget():
    s = _sched(budget=16)
    a, b, c = _req("a", 6, 0), _req("b", 30, 1), _req("c", 5, 2)
    for r in (a, b, c):
        s.add(r)
    p1 = s.schedule()
    assert [(x.request_id, x.num_tokens, x.samples) for x in p1.prefills] == [
        ("a", 6, True), ("b", 10, False)]
    assert not p1.decodes
    apply_plan(s, p1)
    p2 = s.schedule()
    assert [x.request_id for x in p2.decodes] == ["a"]
    # b continues before c is admitted; chunk = budget left after the decode
    assert [(x.request_id, x.start, x.num_tokens) for x in p2.prefills] == [("b", 10, 15)]
    apply_plan(s, p2)
    p3 = s.schedule()
    assert [x.request_id for x in p3.decodes] == ["a"]
    assert [(x.request_id, x.num_tokens) for x in p3.prefills] == [("b", 5), ("c", 5)]
    assert p3.num_tokens == 11


def test_kv_pressure_preempts_the_latest_arrival_and_blocks_are_conserved():
    s = _sched(blocks=4, budget=64, page_size=4)  # 16 token slots
    a, b = _req("a", 8, 0), _req("b", 7, 1)
    s.add(a)
    s.add(b)
    p = s.schedule()
    assert [x.request_id for x in p.prefills] == ["a", "b"]
    apply_plan(s, p)  # a: 9 tokens (needs 3 blocks next), b: 8 tokens (fits 2 blocks, needs 2)
    p = s.schedule()
    assert p.preempted == ("b",)
    assert b.status is RequestStatus.PREEMPTED and b.num_computed == 0 and not b.page_ids
    assert [x.request_id for x in p.decodes] == ["a"]
    assert s.waiting[0] is b
    s.allocator.check()
    assert s.allocator.num_allocated == len(a.page_ids) == 3


def test_finish_and_abort_release_blocks_immediately():
    s = _sched()
    a, b = _req("a", 9, 0), _req("b", 3, 1)
    s.add(a)
    s.add(b)
    apply_plan(s, s.schedule())
    assert s.allocator.num_allocated == 3 + 1
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert s.allocator.num_allocated == 1 and a.page_ids == []
    s.finish(b, RequestStatus.FINISHED_STOPPED)
    assert s.allocator.num_allocated == 0 and not s.has_unfinished()
    s.allocator.check()


def test_running_prefills_stuck_on_memory_do_not_deadlock():
    # Two half-done prefills hold every block and neither can grow (e.g. after recomputes).
    s = _sched(blocks=4, budget=8, page_size=4)
    a, b = _req("a", 12, 0), _req("b", 12, 1)
    for r in (a, b):
        r.page_ids = s.allocator.allocate(2)
        r.num_computed = 8
        r.status = RequestStatus.RUNNING
        s.running.append(r)
    p = s.schedule()
    assert p.preempted == ("b",)
    assert [(x.request_id, x.start, x.num_tokens, x.samples) for x in p.prefills] == [
        ("a", 8, 4, True)]
    s.allocator.check()
    assert s.allocator.num_allocated == 3


def test_requests_with_a_token_in_flight_are_neither_scheduled_nor_preempted():
    """Stream pipeline parallelism: a decode re-enters only after its token left the last
    stage; meanwhile it keeps its place and its blocks and counts against max_num_seqs."""
    s = _sched(blocks=4, budget=16, seqs=2, page_size=4)
    a, b, c = _req("a", 4, 0), _req("b", 3, 1), _req("c", 4, 2)
    for r in (a, b, c):
        s.add(r)
    apply_plan(s, s.schedule())  # a and b prefilled (two sequences at most), both sampled
    assert [r.request_id for r in s.running] == ["a", "b"]
    s.in_flight.add(a)  # as if a's next token were still in a pipeline stage
    plan = s.schedule()
    # Only b decodes; c is not admitted (a still counts against max_num_seqs); a keeps its
    # blocks and its place in the running queue.
    assert [d.request_id for d in plan.decodes] == ["b"] and not plan.prefills
    assert "a" not in plan.preempted and a.page_ids and a.status is RequestStatus.RUNNING
    assert [r.request_id for r in s.running] == ["a", "b"]
    apply_plan(s, plan)
    s.in_flight.discard(a)
    plan = s.schedule()
    assert {d.request_id for d in plan.decodes} == {"a", "b"}
    s.finish(b, RequestStatus.FINISHED_ABORTED)  # while its token is in flight
    tokens = list(b.all_token_ids)
    apply_plan(s, plan)
    assert not s.in_flight and s.has_schedulable()
    assert b.all_token_ids == tokens  # its late token was dropped


def test_async_scheduling_decodes_again_on_a_placeholder_and_drops_a_late_token():
    """A plan's tokens on the device (``sampled_on_device``): the requests get a placeholder
    and decode again before the host reads them; ``update`` writes each token at its
    position; a request that stops on the first token has its second dropped and its blocks
    freed when that plan is back; one whose token ends it by length stays held."""
    s = _sched(blocks=8, budget=16, seqs=4, page_size=4)
    a, b, c = _req("a", 4, 0), _req("b", 3, 1), _req("c", 2, 2, max_tokens=1)
    for r in (a, b, c):
        s.add(r)
    p1 = s.schedule()
    s.sampled_on_device(p1, lambda r, n: r is not c)
    assert a.all_token_ids[-1] == b.all_token_ids[-1] == PLACEHOLDER and c.all_token_ids == [1, 2]
    p2 = s.schedule()  # a and b decode on their placeholders; c waits for its token
    assert [(d.request_id, d.start) for d in p2.decodes] == [("a", 4), ("b", 3)]
    s.sampled_on_device(p2, lambda r, n: True)
    assert a.all_token_ids == [1, 2, 3, 4, PLACEHOLDER, PLACEHOLDER]
    assert [r.request_id for _, r in s.update(p1, [7, 8, 9])] == ["a", "b", "c"]
    assert a.all_token_ids == [1, 2, 3, 4, 7, PLACEHOLDER] and c.all_token_ids == [1, 2, 9]
    s.finish(b, RequestStatus.FINISHED_STOPPED)  # b's 8 was a stop token
    s.finish(c, RequestStatus.FINISHED_LENGTH)
    assert b.page_ids == [] and len(s.page_holders()) == 2  # a's, and b's until p2 is back
    assert [r.request_id for _, r in s.update(p2, [10, 11])] == ["a"]
    assert a.all_token_ids == [1, 2, 3, 4, 7, 10] and b.all_token_ids == [1, 2, 3, 8, PLACEHOLDER]
    assert s.page_holders() == [a.page_ids]
    s.allocator.check_holders(s.page_holders())


def test_a_burst_needs_every_running_request_decoding_and_takes_its_tokens_back():
    """``schedule(burst, may_burst)``: a plan is a burst only when it decodes every running
    request, nobody waits and ``may_burst`` holds for each; its requests' blocks grow to
    hold the burst's KV, their computed counts move by the burst, ``sampled_on_device``
    gives each as many placeholders, and ``update`` writes each request's tokens in order
    (decodes in plan order, each request's steps in a row)."""
    s = _sched(blocks=16, budget=16, seqs=4, page_size=4)
    a, b, c = _req("a", 4, 0, max_tokens=20), _req("b", 3, 1, max_tokens=20), _req("c", 2, 9)
    for r in (a, b):
        s.add(r)
    apply_plan(s, s.schedule())  # both prefilled; each has one token and decodes next
    assert len(a.all_token_ids) == 5 and len(b.all_token_ids) == 4
    yes = lambda r, k: True
    s.add(c)  # waiting: no burst
    plan = s.schedule(4, yes)
    assert plan.burst == 1 and plan.prefills
    apply_plan(s, plan)
    s.finish(c, RequestStatus.FINISHED_ABORTED)
    plan = s.schedule(4, lambda r, k: r is not b)  # b may not burst: nobody does
    assert plan.burst == 1 and [d.request_id for d in plan.decodes] == ["a", "b"]
    apply_plan(s, plan)
    starts = {r.request_id: r.num_computed for r in (a, b)}
    plan = s.schedule(4, yes)
    assert plan.burst == 4 and not plan.prefills
    assert [(d.request_id, d.start, d.num_tokens) for d in plan.decodes] == [
        ("a", starts["a"], 1), ("b", starts["b"], 1)]
    for r in (a, b):  # the KV of 4 tokens from its start fits its blocks; 4 more computed
        assert len(r.page_ids) * 4 >= starts[r.request_id] + 4
        assert r.num_computed == starts[r.request_id] + 4
    s.sampled_on_device(plan, lambda r, n: n == 4)
    assert a.all_token_ids[-4:] == [PLACEHOLDER] * 4 and b.all_token_ids[-4:] == [PLACEHOLDER] * 4
    appended = s.update(plan, [11, 12, 13, 14, 21, 22, 23, 24])
    assert [(i, r.request_id) for i, r in appended] == [
        (0, "a"), (1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "b"), (6, "b"), (7, "b")]
    assert a.all_token_ids[-4:] == [11, 12, 13, 14] and b.all_token_ids[-4:] == [21, 22, 23, 24]
    assert a.num_computed == len(a.all_token_ids) - 1 and b.num_computed == len(b.all_token_ids) - 1
    s.allocator.check_holders(s.page_holders())


def test_a_burst_shortens_to_what_every_request_may_take():
    """A request that may take only 2 more tokens with no host decision (near its
    ``max_tokens``, say) makes the plan a burst of 2, not a single step: the most steps every
    request may take, the blocks grown for those."""
    s = _sched(blocks=16, budget=16, seqs=4, page_size=4)
    a, b = _req("a", 4, 0, max_tokens=20), _req("b", 3, 1, max_tokens=20)
    for r in (a, b):
        s.add(r)
    apply_plan(s, s.schedule())
    starts = {r.request_id: r.num_computed for r in (a, b)}
    asked = []
    plan = s.schedule(4, lambda r, k: asked.append(k) or r is not b or k <= 2)
    assert plan.burst == 2 and [d.request_id for d in plan.decodes] == ["a", "b"]
    assert sorted(set(asked), reverse=True) == [4, 3, 2]
    for r in (a, b):
        assert r.num_computed == starts[r.request_id] + 2
    s.allocator.check_holders(s.page_holders())


def test_a_burst_the_pool_cannot_hold_is_one_step_and_takes_no_block():
    s = _sched(blocks=4, budget=16, seqs=4, page_size=4)  # 4 usable blocks of 4 tokens
    a, b = _req("a", 4, 0, max_tokens=20), _req("b", 3, 1, max_tokens=20)
    for r in (a, b):
        s.add(r)
    apply_plan(s, s.schedule())
    # One step: a needs a 2nd block (5 tokens), b none; 8 steps: a a 3rd, b two more.
    plan = s.schedule(8, lambda r, k: True)
    assert plan.burst == 1 and [d.request_id for d in plan.decodes] == ["a", "b"]
    assert (len(a.page_ids), len(b.page_ids), s.allocator.num_free) == (2, 1, 1)
    s.allocator.check_holders(s.page_holders())


# -- KV-cache parallel groups (kvp): per-group pools and the group-boundary rules -------------


def test_grouped_allocator_conserves_blocks_per_group_under_random_traffic():
    alloc = PageAllocator(9, 4, groups=3, pages_per_group=3)  # 8 usable pages per group
    rng = random.Random(0)
    seqs: list[list[int]] = []
    for _ in range(400):
        if seqs and rng.random() < 0.35:
            alloc.free(seqs.pop(rng.randrange(len(seqs))))
        elif seqs and rng.random() < 0.5:
            seq = rng.choice(seqs)
            n = rng.randint(1, 3)
            if len(seq) + n <= 9 and alloc.can_extend(seq, n):
                seq += alloc.extend(seq, n)
            elif len(seq) + n <= 9:
                with pytest.raises(OutOfPages):
                    alloc.extend(seq, n)
        else:
            n = rng.randint(1, 5)
            if alloc.can_extend([], n):
                seqs.append(alloc.extend([], n))
        alloc.check()
        assert alloc.num_allocated == sum(map(len, seqs))
        for seq in seqs:  # logical page j lives in group (start + j // 3) % 3, never a sink
            start = alloc.group_of(seq[0])
            assert [alloc.group_of(b) for b in seq] == [(start + j // 3) % 3
                                                        for j in range(len(seq))]
            assert all(b % 9 for b in seq)
    for seq in seqs:
        alloc.free(seq)
    alloc.check()
    assert alloc.num_free == alloc.total == 24
    with pytest.raises(ValueError, match="at most 9 pages"):
        alloc.extend([], 10)


def test_new_sequences_start_on_the_least_loaded_group():
    alloc = PageAllocator(9, 4, groups=3, pages_per_group=3)
    a = alloc.extend([], 2)                          # all equal: group 0
    assert {alloc.group_of(b) for b in a} == {0}
    b = alloc.extend([], 3)                          # groups 1 and 2 tie: group 1
    assert {alloc.group_of(x) for x in b} == {1}
    c = alloc.extend([], 5)                          # group 2 is free-est; spills into 0
    assert [alloc.group_of(x) for x in c] == [2, 2, 2, 0, 0]
    assert [alloc.num_free_in(g) for g in range(3)] == [4, 5, 5]
    assert alloc.start_group([]) == 1
    # A sequence's capacity: the rest of its current group's chunk, then the next groups'
    # chunks while their pools have room, up to 3 groups x 3 pages.
    assert alloc.extendable(c) == 1 + 3 and alloc.extendable(a) == 1 + 3 + 3
    alloc.extend([], 3)                              # group 1 (5 free) -> 2 left there
    assert alloc.num_free_in(1) == 2
    assert alloc.extendable(a) == 1 + 2              # a's next chunk (group 1) is short
    assert alloc.can_extend(a, 3) and not alloc.can_extend(a, 4)


def _grouped_sched(**kw):
    # 4-token pages, 2 pages a group: L = 8 tokens per group, 3 groups, 7 usable pages each.
    return SarathiScheduler(PageAllocator(8, 4, groups=3, pages_per_group=2), **{
        "max_num_seqs": 8, "max_num_batched_tokens": 32, "max_prefill_seqs": 4, **kw})


def test_prefill_chunks_stop_at_group_boundaries():
    s = _grouped_sched()
    a = _req("a", 20, 0)
    s.add(a)
    sizes = []
    while a.num_computed < 20:
        plan = s.schedule()
        sizes.append([(c.start, c.num_tokens) for c in plan.prefills])
        apply_plan(s, plan)
    assert sizes == [[(0, 8)], [(8, 8)], [(16, 4)]]  # never across 8 or 16
    s.allocator.check()


def test_group_boundary_clip_also_applies_to_deadline_chunks():
    pred = LinearPredictor((0.0, 1e-3, 0.0, 0.0, 0.0, 0.0))
    cfg = DeadlineConfig(t_target=1.0, chunk_granularity=2)
    s = DeadlineScheduler(PageAllocator(8, 4, groups=3, pages_per_group=2), policy="edf",
                          predictor=pred, prefill_cache=PrefillTimeCache(pred, 64, 1.0),
                          max_num_seqs=8, max_num_batched_tokens=32, max_prefill_seqs=4,
                          config=cfg, clock=lambda: 0.0)
    a = _req("a", 20, 0)
    s.add(a)
    plan = s.schedule()
    assert [(c.start, c.num_tokens) for c in plan.prefills] == [(0, 8)]


def test_at_most_one_group_spanning_prefill_per_batch():
    s = _grouped_sched()
    a, b, c = _req("a", 12, 0), _req("b", 14, 1), _req("c", 5, 2)  # a and b span groups
    for r in (a, b, c):
        s.add(r)
    p1 = s.schedule()
    # b waits while a (spanning) prefills; Sarathi admits in arrival order, so c waits too.
    assert [(x.request_id, x.num_tokens) for x in p1.prefills] == [("a", 8)]
    apply_plan(s, p1)
    p2 = s.schedule()
    assert [x.request_id for x in p2.prefills] == ["a"]
    apply_plan(s, p2)
    p3 = s.schedule()  # a decodes now; b may start
    assert [x.request_id for x in p3.decodes] == ["a"]
    assert [(x.request_id, x.num_tokens) for x in p3.prefills][:1] == [("b", 8)]
    s.allocator.check()


def test_deadline_policy_runs_one_group_spanning_prefill_per_batch():
    pred = LinearPredictor((0.0, 1e-4, 0.0, 0.0, 0.0, 0.0))
    s = DeadlineScheduler(PageAllocator(8, 4, groups=3, pages_per_group=2), policy="edf",
                          predictor=pred, prefill_cache=PrefillTimeCache(pred, 64, 1.0),
                          max_num_seqs=8, max_num_batched_tokens=32, max_prefill_seqs=4,
                          config=DeadlineConfig(t_target=1.0, chunk_granularity=2),
                          clock=lambda: 0.0)
    a, b, c = _req("a", 12, 0), _req("b", 14, 1), _req("c", 5, 2)
    for r in (a, b, c):
        s.add(r)
    plan = s.schedule()
    assert [(x.request_id, x.num_tokens) for x in plan.prefills] == [("a", 8), ("c", 5)]

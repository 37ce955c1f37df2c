"""Sarathi policy decisions on constructed cases (pure Python, no device)."""
from __future__ import annotations

from jserve.cache.allocator import BlockAllocator
from jserve.scheduler import Request, RequestStatus, SarathiScheduler


def _sched(blocks=64, budget=16, seqs=8, prefill_seqs=4, block_size=4):
    return SarathiScheduler(BlockAllocator(blocks + 1, block_size), max_num_seqs=seqs,
                            max_num_batched_tokens=budget, max_prefill_seqs=prefill_seqs)


def _req(rid, prompt_len, t, max_tokens=8):
    return Request(rid, list(range(1, prompt_len + 1)), max_tokens, float(t))


def _run(s, plan, sample_token=5):
    """Apply a plan as the engine would: advance computed counts, append sampled tokens."""
    by_id = {r.request_id: r for r in s.running}
    for c in plan.decodes + plan.prefills:
        r = by_id[c.request_id]
        r.num_computed += c.num_tokens
        if c.samples:
            r.token_ids.append(sample_token)


def test_decodes_first_then_prefill_chunks_in_arrival_order_under_the_budget():
    s = _sched(budget=16)
    a, b, c = _req("a", 6, 0), _req("b", 30, 1), _req("c", 5, 2)
    for r in (a, b, c):
        s.add(r)
    p1 = s.schedule()
    assert [(x.request_id, x.num_tokens, x.samples) for x in p1.prefills] == [
        ("a", 6, True), ("b", 10, False)]
    assert not p1.decodes
    _run(s, p1)
    p2 = s.schedule()
    assert [x.request_id for x in p2.decodes] == ["a"]
    # b continues before c is admitted; chunk = budget left after the decode
    assert [(x.request_id, x.start, x.num_tokens) for x in p2.prefills] == [("b", 10, 15)]
    _run(s, p2)
    p3 = s.schedule()
    assert [x.request_id for x in p3.decodes] == ["a"]
    assert [(x.request_id, x.num_tokens) for x in p3.prefills] == [("b", 5), ("c", 5)]
    assert p3.num_tokens == 11


def test_kv_pressure_preempts_the_latest_arrival_and_blocks_are_conserved():
    s = _sched(blocks=4, budget=64, block_size=4)  # 16 token slots
    a, b = _req("a", 8, 0), _req("b", 7, 1)
    s.add(a)
    s.add(b)
    p = s.schedule()
    assert [x.request_id for x in p.prefills] == ["a", "b"]
    _run(s, p)  # a: 9 tokens (needs 3 blocks next), b: 8 tokens (fits 2 blocks, needs 2)
    p = s.schedule()
    assert p.preempted == ("b",)
    assert b.status is RequestStatus.PREEMPTED and b.num_computed == 0 and not b.block_ids
    assert [x.request_id for x in p.decodes] == ["a"]
    assert s.waiting[0] is b
    s.allocator.check()
    assert s.allocator.num_allocated == len(a.block_ids) == 3


def test_finish_and_abort_release_blocks_immediately():
    s = _sched()
    a, b = _req("a", 9, 0), _req("b", 3, 1)
    s.add(a)
    s.add(b)
    _run(s, s.schedule())
    assert s.allocator.num_allocated == 3 + 1
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert s.allocator.num_allocated == 1 and a.block_ids == []
    s.finish(b, RequestStatus.FINISHED_STOPPED)
    assert s.allocator.num_allocated == 0 and not s.has_unfinished()
    s.allocator.check()


def test_running_prefills_stuck_on_memory_do_not_deadlock():
    # Two half-done prefills hold every block and neither can grow (e.g. after recomputes).
    s = _sched(blocks=4, budget=8, block_size=4)
    a, b = _req("a", 12, 0), _req("b", 12, 1)
    for r in (a, b):
        r.block_ids = s.allocator.allocate(2)
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
    s = _sched(blocks=4, budget=16, seqs=2, block_size=4)
    a, b, c = _req("a", 4, 0), _req("b", 3, 1), _req("c", 4, 2)
    for r in (a, b, c):
        s.add(r)
    _run(s, s.schedule())  # a and b prefilled (two sequences at most), both sampled
    assert [r.request_id for r in s.running] == ["a", "b"]
    s.hold([a])
    plan = s.schedule()
    # Only b decodes; c is not admitted (a still counts against max_num_seqs); a keeps its
    # blocks and its place in the running queue.
    assert [d.request_id for d in plan.decodes] == ["b"] and not plan.prefills
    assert "a" not in plan.preempted and a.block_ids and a.status is RequestStatus.RUNNING
    assert [r.request_id for r in s.running] == ["a", "b"]
    _run(s, plan)
    s.release(a)
    assert {d.request_id for d in s.schedule().decodes} == {"a", "b"}
    s.hold([b])
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not s.in_flight and s.has_schedulable()

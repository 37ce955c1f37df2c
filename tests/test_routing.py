"""Routing policies decide from constructed replica reports (pure functions, no device), and a
replica's report is read from a real scheduler."""
from __future__ import annotations

import dataclasses
import math

import pytest

from jserve.cache.allocator import PageAllocator
from jserve.routing import (
    PrefillTable,
    QueuedPrefill,
    ReplicaLoad,
    ReplicaView,
    Router,
    RouteRequest,
    choose,
    predicted_ttft,
)
from jserve.routing.load import DEADLINE_ORDER, FIFO
from jserve.routing.replica import cached_tokens, prefill_table, replica_load
from jserve.scheduler import Request, SarathiScheduler
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import DeadlineConfig, DeadlineScheduler
from jserve.scheduler.predictor import LinearPredictor

# 1 ms a prompt token, nothing else: T(n) = n / 1000 s.
TABLE = PrefillTable((0, 1_000_000), (0.0, 1000.0))


def _load(name="r", *, prefills=(), waiting=0, running=0, kv=0.0, order=FIFO, healthy=True,
          long_threshold=32768):
    return ReplicaLoad(name, healthy, waiting, running, kv, order,
                       tuple(QueuedPrefill(*p) for p in prefills), TABLE, long_threshold)


def _pick(policy, views, tokens=100, slo=None, seq=0):
    return choose(policy, RouteRequest(tokens, slo, seq), views)


def test_a_short_request_goes_to_the_idle_replica_not_behind_a_long_prefill():
    busy = _load("a", prefills=[(math.inf, 8.0, 8000)], running=1)  # prefilling a document
    idle = _load("b", running=3)  # three decodes: more requests, no prefill work
    views = [ReplicaView(busy), ReplicaView(idle)]
    assert predicted_ttft(busy, 100) == pytest.approx(8.1)
    assert predicted_ttft(idle, 100) == pytest.approx(0.1)
    assert _pick("deadline", views) == 1
    assert _pick("least_load", views) == 0  # fewer requests, but 8 s of prefill ahead
    assert _pick("round_robin", views, seq=0) == 0


def test_a_prefix_hit_is_taken_only_when_it_costs_no_deadline():
    cached = _load("a", prefills=[(math.inf, 0.3, 300)], running=1)
    other = _load("b")
    # 2,000-token prompt, 1,600 cached on a: 0.3 + 0.4 = 0.7 s there, 2.0 s on b.
    views = [ReplicaView(cached, 1600), ReplicaView(other)]
    assert _pick("deadline", views, tokens=2000, slo=3.0) == 0
    assert _pick("prefix", views, tokens=2000, slo=3.0) == 0
    assert _pick("least_load", views, tokens=2000, slo=3.0) == 1
    # The same hit behind 5 s of queued work misses a 3 s deadline that b meets.
    jammed = _load("a", prefills=[(math.inf, 5.0, 5000)], running=1)
    views = [ReplicaView(jammed, 1600), ReplicaView(other)]
    assert _pick("deadline", views, tokens=2000, slo=3.0) == 1
    assert _pick("prefix", views, tokens=2000, slo=3.0) == 0
    # Both meet it and b answers sooner: the hit wins within 10% (2.1 s vs 2.0 s), not past.
    near = _load("a", prefills=[(math.inf, 1.7, 1700)], running=1)
    far = _load("a", prefills=[(math.inf, 2.0, 2000)], running=1)
    assert _pick("deadline", [ReplicaView(near, 1600), ReplicaView(other)], 2000, 10.0) == 0
    assert _pick("deadline", [ReplicaView(far, 1600), ReplicaView(other)], 2000, 10.0) == 1


def test_long_requests_spread_over_replicas_that_meet_their_deadline():
    one_long = _load("a", prefills=[(math.inf, 1.0, 40_000)], running=1)
    shorts = _load("b", prefills=[(math.inf, 0.5, 500), (math.inf, 0.6, 600)], running=2)
    views = [ReplicaView(one_long), ReplicaView(shorts)]
    # A 50K-token request (50 s alone) meets its default deadline (75 s) on both: the one
    # with no long prefill gets it although it predicts 0.1 s later.
    assert predicted_ttft(one_long, 50_000) < predicted_ttft(shorts, 50_000)
    assert _pick("deadline", views, tokens=50_000) == 1
    # A short one goes where it is answered soonest.
    assert _pick("deadline", views, tokens=100) == 0


def test_when_no_replica_meets_the_deadline_the_least_late_gets_it():
    views = [ReplicaView(_load("a", prefills=[(math.inf, 9.0, 9000)])),
             ReplicaView(_load("b", prefills=[(math.inf, 4.0, 4000)])),
             ReplicaView(_load("c", prefills=[(math.inf, 6.0, 6000)]))]
    assert _pick("deadline", views, tokens=100, slo=1.0) == 1


def test_a_long_request_late_everywhere_queues_behind_the_documents_not_on_the_idle_replica():
    docs = _load("a", prefills=[(math.inf, 300.0, 300_000), (math.inf, 200.0, 200_000)])
    busy = _load("b", prefills=[(math.inf, 100.0, 100_000)])
    idle = _load("c")
    views = [ReplicaView(docs), ReplicaView(busy), ReplicaView(idle)]
    # 200K tokens (200 s alone) due in 100 s: no replica meets it; c is the least late but
    # it goes behind the two documents on a, and c stays free for a short request.
    assert _pick("deadline", views, tokens=200_000, slo=100.0) == 0
    assert _pick("deadline", views, tokens=100) == 2
    # Due in 300 s: c meets it, so it goes there.
    assert _pick("deadline", views, tokens=200_000, slo=300.0) == 2


def test_a_replica_with_every_sequence_slot_taken_gets_a_request_only_if_all_are_full():
    full = dataclasses.replace(_load("a", running=4), max_num_seqs=4)  # no prefill queued
    queued = dataclasses.replace(_load("b", prefills=[(math.inf, 0.3, 300)], running=2,
                                       waiting=1), max_num_seqs=4)
    views = [ReplicaView(full), ReplicaView(queued)]
    assert full.slots_full and not queued.slots_full
    # a's queue is empty, but the request would wait there for a request to finish.
    assert _pick("deadline", views, tokens=100) == 1
    assert _pick("deadline", [ReplicaView(dataclasses.replace(full, max_num_seqs=0)),
                              views[1]], tokens=100) == 0  # slots unknown: never full
    # Both full: the one with fewer requests ahead for a slot, whatever its prefill queue.
    fuller = dataclasses.replace(_load("c", running=4, waiting=2), max_num_seqs=4)
    both = [ReplicaView(fuller), ReplicaView(dataclasses.replace(queued, max_num_seqs=3))]
    assert _pick("deadline", both, tokens=100) == 1
    # A document late everywhere still queues behind the documents, full or not.
    docs = dataclasses.replace(_load("d", prefills=[(math.inf, 300.0, 300_000)], running=4),
                               max_num_seqs=4)
    assert _pick("deadline", [ReplicaView(docs), views[1]], tokens=200_000, slo=100.0) == 0
    assert ReplicaLoad.from_dict(full.to_dict()) == full


def test_a_deadline_ordered_replica_runs_earlier_deadlines_first():
    # LARS-like replica: a long prefill due in 60 s does not delay a short one due in 0.5 s;
    # one due in 0.2 s does.
    lars = _load("a", order=DEADLINE_ORDER, prefills=[(60.0, 8.0, 8000)])
    assert predicted_ttft(lars, 100) == pytest.approx(0.1)
    lars2 = _load("a", order=DEADLINE_ORDER, prefills=[(60.0, 8.0, 8000), (0.2, 0.3, 300)])
    assert predicted_ttft(lars2, 100) == pytest.approx(0.4)
    fifo = _load("b", prefills=[(60.0, 8.0, 8000)])
    assert _pick("deadline", [ReplicaView(fifo), ReplicaView(lars)]) == 1


def test_a_lars_replica_runs_quick_and_due_prefills_first():
    # quick_s 0.2 s, t_target 0.05 s: a 8 s document that is late (due -1 s), one due in
    # 0.03 s (0.5 s of work) and a quick 0.1 s one.
    lars = dataclasses.replace(_load("a", order=DEADLINE_ORDER, prefills=[
        (-1.0, 8.0, 8000), (0.03, 0.5, 500), (5.0, 0.1, 100)]), t_target=0.05, quick_s=0.2)
    # A quick newcomer (0.15 s) waits only for quick/due ones with less work: the 0.1 s one.
    assert predicted_ttft(lars, 150) == pytest.approx(0.25)
    # A 1 s newcomer (due at 1.5 s) waits for the due/quick ones and the late document.
    assert predicted_ttft(lars, 1000) == pytest.approx(0.5 + 0.1 + 8.0 + 1.0)
    # Without the due-first class it is the deadline order alone.
    plain = dataclasses.replace(lars, quick_s=0.0)
    assert predicted_ttft(plain, 150) == pytest.approx(8.0 + 0.5 + 0.15)


def test_unhealthy_replicas_are_skipped_and_none_healthy_is_an_error():
    views = [ReplicaView(_load("a", healthy=False)), ReplicaView(_load("b", running=5))]
    for policy in ("round_robin", "least_load", "prefix", "deadline"):
        assert _pick(policy, views, seq=0) == 1
        assert _pick(policy, views, seq=1) == 1
    with pytest.raises(ValueError, match="no healthy replica"):
        _pick("deadline", [ReplicaView(_load("a", healthy=False))])
    with pytest.raises(ValueError, match="router must be one of"):
        _pick("random", views)


def test_round_robin_turns_and_least_load_counts_requests_then_kv():
    views = [ReplicaView(_load(str(i), running=r, kv=kv))
             for i, (r, kv) in enumerate([(2, 0.1), (1, 0.9), (1, 0.2)])]
    router = Router("round_robin")
    assert [router.route(10, views) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert _pick("least_load", views) == 2


def test_the_choice_is_a_function_of_the_reports_alone():
    """Reports that went through JSON (as over HTTP or Ray) give the same decisions."""
    loads = [_load("a", order=DEADLINE_ORDER, prefills=[(math.inf, 3.0, 3000), (0.4, 0.2, 200)],
                   waiting=1, running=1, kv=0.5),
             _load("b", prefills=[(2.0, 1.0, 1000)], running=4, kv=0.2)]
    again = [ReplicaLoad.from_dict(x.to_dict()) for x in loads]
    assert again == loads
    for policy in ("round_robin", "least_load", "prefix", "deadline"):
        for tokens, cached, slo, seq in [(100, (0, 0), None, 0), (3000, (2048, 0), 2.0, 1),
                                         (40_000, (0, 0), None, 2)]:
            a = _pick(policy, [ReplicaView(x, c) for x, c in zip(loads, cached)],
                      tokens, slo, seq)
            b = _pick(policy, [ReplicaView(x, c) for x, c in zip(again, cached)],
                      tokens, slo, seq)
            assert a == b


def test_prefill_table_interpolates_and_extrapolates():
    t = PrefillTable.sample(lambda n: 0.001 * n + 1e-7 * n * n, 10_000, drain_s=0.01)
    assert t.time(0) == 0.0
    assert t.time(10_000) == pytest.approx(20.0)
    assert t.remaining(10_000, 10_000) == 0.0
    assert t.remaining(10_000, 0) == pytest.approx(20.01)
    assert t.time(5_000) == pytest.approx(7.5, rel=0.02)
    assert t.time(20_000) > t.time(10_000)
    with pytest.raises(ValueError):
        PrefillTable((0,), (0.0,))


def _reqs():
    doc = list(range(1, 65))  # 64 tokens: 16 pages of 4
    return doc, Request("long", list(range(100, 400)), 4, 0.0), Request("doc", doc, 4, 0.0)


def test_a_sarathi_replica_reports_its_queue_and_its_cached_prefix():
    s = SarathiScheduler(PageAllocator(200, 4, prefix_caching=True), max_num_seqs=8,
                         max_num_batched_tokens=16, max_prefill_seqs=4)
    doc, long_req, doc_req = _reqs()
    s.add(doc_req)
    while doc_req.num_output_tokens == 0:  # prefill the document; its pages get cached
        plan = s.schedule()
        s.update(plan, [7] * sum(c.samples for c in plan.decodes + plan.prefills))
    s.add(long_req)
    plan = s.schedule()  # the doc decodes, the long prompt takes a first chunk
    s.update(plan, [7] * sum(c.samples for c in plan.decodes + plan.prefills))
    load = replica_load("r0", s, TABLE, now=0.0)
    assert load.order == FIFO and load.running == 2 and load.waiting == 0
    assert load.max_num_seqs == 8 and not load.slots_full
    left = 300 - long_req.num_computed
    assert [(p.tokens, p.due_s) for p in load.prefills] == [(left, math.inf)]
    assert load.prefills[0].work_s == pytest.approx(left / 1000)
    assert load.kv_usage == pytest.approx(s.allocator.num_allocated / s.allocator.total)
    # A new prompt sharing the document's first 40 tokens: 10 full pages are cached.
    assert cached_tokens(s, doc[:40] + [999] * 20) == 40
    assert cached_tokens(s, [999] + doc) == 0


def test_a_deadline_replica_reports_deadlines_relative_to_now():
    predictor = LinearPredictor((0.0, 1e-3, 0.0, 0.0, 0.0, 0.0))
    cache = PrefillTimeCache(predictor, 4096, 0.05)
    now = [0.0]
    s = DeadlineScheduler(PageAllocator(400, 4), policy="lars", predictor=predictor,
                          prefill_cache=cache, max_num_seqs=8, max_num_batched_tokens=64,
                          max_prefill_seqs=4, config=DeadlineConfig(t_target=0.05),
                          clock=lambda: now[0])
    _, long_req, _ = _reqs()
    s.add(long_req)  # 300 tokens: 0.3 s alone, due at max(1.5 x 0.3, 0.5) = 0.5 s
    now[0] = 0.2
    load = replica_load("r1", s, prefill_table(cache, 4096), now=now[0])
    assert load.order == DEADLINE_ORDER
    (p,) = load.prefills
    assert p.due_s == pytest.approx(0.3) and p.work_s == pytest.approx(0.3, rel=0.01)
    assert load.t_target == 0.05 and load.quick_s == pytest.approx(4 * 0.05)
    # A quick newcomer (0.05 s of work <= 0.2 s) runs first, whatever its deadline.
    assert predicted_ttft(load, 50, ttft_slo=0.25) == pytest.approx(0.05, rel=0.05)
    assert predicted_ttft(load, 50, ttft_slo=1.0) == pytest.approx(0.05, rel=0.05)
    # A 250-token one (0.25 s) waits for the long one only if that is due first.
    assert predicted_ttft(load, 250, ttft_slo=0.25) == pytest.approx(0.25, rel=0.05)
    assert predicted_ttft(load, 250, ttft_slo=1.0) == pytest.approx(0.55, rel=0.05)


def test_prefix_memory_guesses_cached_pages_from_where_prompts_went():
    from jserve.routing.prefix_memory import PrefixMemory
    m = PrefixMemory(page_size=4, capacity=5)
    doc = list(range(1, 21))  # 5 pages of 4
    m.record("a", doc)
    assert m.cached_tokens("a", doc[:12] + [99, 98]) == 12
    assert m.cached_tokens("a", doc) == 16  # the last token is always computed
    assert m.cached_tokens("b", doc) == 0
    assert m.cached_tokens("a", [0] + doc) == 0  # the same tokens at other positions
    m.record("a", [50, 51, 52, 53, 54, 55, 56, 57, 58])  # 2 more pages: doc's first one goes
    assert m.cached_tokens("a", doc) == 0  # its first page is gone, so no run starts
    m.forget("a")
    assert m.cached_tokens("a", [50, 51, 52, 53, 54]) == 0

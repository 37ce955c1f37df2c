"""Automatic prefix caching: the allocator's reference counts and LRU on constructed cases,
the scheduler's use of the cache (and LARS ranking by uncached work), conservation under
random shared traffic, and greedy tokens / logprobs identical with caching on and off."""
from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings, strategies as st

from conftest import apply_plan
from jserve.cache.allocator import PageAllocator
from jserve.cache.prefix import extend_page_keys
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import DeadlineConfig, DeadlineScheduler
from jserve.scheduler.predictor import LinearPredictor
from jserve.scheduler.request import Request, RequestStatus
from jserve.scheduler.sarathi import SarathiScheduler
from jserve.sim import VirtualClock


def _keys(tokens, page=4):
    return extend_page_keys([], tokens, page, len(tokens) // page)


# -- page keys and the allocator ----------------------------------------------------------
def test_page_keys_match_only_when_every_earlier_token_matches():
    a = _keys([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = _keys([1, 2, 3, 4, 5, 6, 7, 8, 0, 10, 11, 12])
    c = _keys([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c))  # same page tokens, different history
    assert len(_keys([1, 2, 3, 4, 5, 6, 7])) == 1  # only full pages


def _cached_allocator(blocks=6, page=4):
    return PageAllocator(blocks + 1, page, prefix_caching=True)


def test_lookup_acquire_and_reference_counts():
    alloc = _cached_allocator()
    keys = _keys(list(range(12)))
    mine = alloc.allocate(3)
    for b, k in zip(mine, keys):
        alloc.register(b, k)
    assert alloc.lookup(keys) == mine
    assert alloc.lookup(_keys(list(range(8)) + [99, 99, 99, 99])) == mine[:2]
    alloc.acquire(mine[:2])             # a second sequence shares two pages
    alloc.free(mine)                    # the first owner finishes
    assert alloc.num_allocated == 2 and alloc.num_idle == 1 and alloc.num_cached == 3
    alloc.check()
    alloc.check_holders([mine[:2]])
    alloc.free(mine[:2])
    assert alloc.num_allocated == 0 and alloc.num_idle == 3 and alloc.num_free == 6
    alloc.check()


def test_idle_pages_are_evicted_least_recently_used_first_and_never_block_admission():
    alloc = _cached_allocator(blocks=4, page=4)
    docs = [[d * 100 + i for i in range(4)] for d in range(4)]
    blocks = []
    for doc in docs:
        (b,) = alloc.allocate(1)
        alloc.register(b, _keys(doc)[0])
        blocks.append(b)
    for b in (blocks[2], blocks[0], blocks[3], blocks[1]):  # idle in this order (LRU first)
        alloc.free([b])
    alloc.acquire([blocks[0]])         # used again: no longer idle
    alloc.free([blocks[0]])            # idle again, now the most recent
    assert alloc.num_free == 4 and alloc.can_allocate(4)  # a full cache admits anyone
    new = alloc.allocate(2)
    assert new == [blocks[2], blocks[3]] and alloc.num_evictions == 2
    assert alloc.lookup(_keys(docs[2])) == [] and alloc.lookup(_keys(docs[1])) == [blocks[1]]
    alloc.check()


def test_eviction_takes_a_sequences_tail_before_its_head():
    """A finished sequence's pages go idle last page first: evicting two pages drops its last
    two, and the head still hits (head-first eviction would leave no page reachable)."""
    alloc = _cached_allocator(blocks=4, page=4)
    keys = _keys(list(range(16)))
    mine = alloc.allocate(4)
    for b, k in zip(mine, keys):
        alloc.register(b, k)
    alloc.free(mine)
    new = alloc.allocate(2)
    assert sorted(new) == sorted(mine[2:]) and alloc.num_evictions == 2
    assert alloc.lookup(keys) == mine[:2]
    alloc.check()


def test_a_recycled_page_is_never_found_before_it_is_written_again():
    alloc = _cached_allocator(blocks=1, page=4)
    key = _keys([1, 2, 3, 4])[0]
    (b,) = alloc.allocate(1)
    alloc.register(b, key)
    alloc.free([b])
    (again,) = alloc.allocate(1)       # evicts the idle page for a new sequence
    assert again == b and alloc.lookup([key]) == []
    alloc.free([again])                # never registered: plainly free, not idle
    assert alloc.num_idle == 0 and alloc.num_cached == 0
    alloc.check()


def test_kvp_groups_a_hit_stops_where_a_page_is_not_in_its_logical_group():
    alloc = PageAllocator(5, 4, groups=2, pages_per_group=2, prefix_caching=True)
    keys = _keys(list(range(16)))
    seq = alloc.extend([], 4)          # two pages in one group, then two in the other
    for b, k in zip(seq, keys):
        alloc.register(b, k)
    alloc.free(seq)
    assert alloc.lookup(keys) == seq
    assert [alloc.group_of(b) for b in seq] == [alloc.group_of(seq[0])] * 2 + [
        1 - alloc.group_of(seq[0])] * 2
    alloc.check()


# -- the scheduler ------------------------------------------------------------------------
def _sarathi(blocks=64, page=4, budget=16, seqs=4):
    return SarathiScheduler(PageAllocator(blocks + 1, page, prefix_caching=True),
                            max_num_seqs=seqs, max_num_batched_tokens=budget, max_prefill_seqs=2)


def test_a_request_starts_after_its_cached_prefix_and_only_after_computed_pages():
    sched = _sarathi(budget=8)
    doc = list(range(100, 124))        # 6 full pages
    a = Request("a", doc + [1, 2], 4, 0.0)
    sched.add(a)
    apply_plan(sched, sched.schedule())    # a: 8 of 26 tokens computed (2 pages)
    b = Request("b", doc + [3], 4, 0.1)  # arrives while a's prefix is being prefilled
    sched.add(b)
    sched.token_budget = 40            # room for a's remaining 18 tokens and b's chunk
    plan = sched.schedule()
    (cb,) = [c for c in plan.prefills if c.request_id == "b"]
    assert cb.start == 8 and b.page_ids[:2] == a.page_ids[:2]   # the 2 computed pages only
    assert b.num_cached_tokens == 8
    sched.allocator.check_holders([r.page_ids for r in sched.running])
    sched.allocator.check()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = _sarathi()
    prompt = list(range(50, 66))       # exactly 4 pages
    first = Request("first", prompt, 1, 0.0)
    sched.add(first)
    while first.status is not RequestStatus.FINISHED_LENGTH:
        plan = sched.schedule()
        apply_plan(sched, plan)
        if first.num_output_tokens:
            sched.finish(first, RequestStatus.FINISHED_LENGTH)
    again = Request("again", prompt, 1, 1.0)
    sched.add(again)
    (c,) = sched.schedule().prefills
    assert (c.start, c.num_tokens, c.samples) == (12, 4, True)
    assert sched.prefix_hit_tokens == 12 and sched.prefix_queried_tokens == 32


def test_lars_ranks_a_request_with_a_long_cached_prefix_by_its_uncached_work():
    predictor = LinearPredictor((0.0, 1e-3, 0.0, 0.0, 0.0, 0.0))  # 1 ms a token
    config = DeadlineConfig(t_target=0.05, chunk_granularity=16, long_threshold=10**6,
                            quick_first=0.0)  # LARS's own key (quick first: below)
    clock = VirtualClock(0.0)
    alloc = PageAllocator(2001, 16, prefix_caching=True)
    sched = DeadlineScheduler(alloc, policy="lars", predictor=predictor,
                              prefill_cache=PrefillTimeCache(predictor, 20_000, 0.05),
                              max_num_seqs=8, max_num_batched_tokens=64, max_prefill_seqs=1,
                              config=config, clock=clock)
    doc = [7] * 8000
    owner = Request("owner", doc, 1, 0.0)
    owner.page_ids = alloc.allocate(500)
    sched.advance(owner, 8000)          # the document's 500 pages are cached
    alloc.free(owner.page_ids)
    # Same deadline for both. Counted in full, "cached" (8,016 tokens, 8 s of work) would be
    # hopelessly late and go first; by its uncached work (16 tokens) it has the most slack
    # per unit of work left, so the plain 2,000-token prompt goes first.
    cached = Request("cached", doc + [1] * 16, 1, 0.0)
    cached.ttft_deadline = 3.0
    plain = Request("plain", [2] * 2000, 1, 0.0)
    plain.ttft_deadline = 3.0
    sched.add(plain)
    sched.add(cached)
    assert cached.cached_hint == 8000
    assert sched.remaining_work(cached) == pytest.approx(0.016)
    assert sched.key(cached, 0.0) > sched.key(plain, 0.0)
    # With quick first (the default) its 16 ms of uncached work make it quick: it goes first,
    # ahead of the 2 s prompt (counted in full, 8 s, it would not be quick).
    sched.config = dataclasses.replace(config, quick_first=4.0)
    assert sched.key(cached, 0.0) < -1.0 < sched.key(plain, 0.0)
    sched.config = config
    plan = sched.schedule()
    assert [c.request_id for c in plan.prefills] == ["plain"]
    cached.cached_hint = 0              # what a cache-blind ranking would see
    assert sched.key(cached, 0.0) < sched.key(plain, 0.0)
    # Its default TTFT deadline comes from the uncached prefill time (floor 0.5 s here).
    again = Request("again", doc + [3] * 16, 1, 1.0)
    sched.add(again)
    assert again.ttft_deadline == pytest.approx(1.0 + 0.5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), page=st.sampled_from([1, 4, 16]),
       blocks=st.integers(8, 120), policy=st.sampled_from(["sarathi", "lars", "edf"]))
def test_conservation_and_exact_sharing_under_random_shared_traffic(seed, page, blocks, policy):
    rng = random.Random(seed)
    alloc = PageAllocator(blocks + 1, page, prefix_caching=True)
    if policy == "sarathi":
        sched = SarathiScheduler(alloc, max_num_seqs=6, max_num_batched_tokens=24,
                                 max_prefill_seqs=2)
    else:
        predictor = LinearPredictor((1e-3, 1e-4, 0.0, 0.0, 0.0, 0.0))
        sched = DeadlineScheduler(alloc, policy=policy, predictor=predictor,
                                  prefill_cache=PrefillTimeCache(predictor, 4096, 0.01),
                                  max_num_seqs=6, max_num_batched_tokens=24, max_prefill_seqs=2,
                                  config=DeadlineConfig(t_target=0.01, chunk_granularity=4),
                                  clock=VirtualClock(0.0))
    docs = [[rng.randrange(50) for _ in range(rng.randrange(1, 60))] for _ in range(3)]
    reqs = []
    for step in range(120):
        if rng.random() < 0.3 and len(reqs) < 40:
            prompt = rng.choice(docs)[:rng.randrange(1, 61)] + [rng.randrange(50)
                                                                for _ in range(rng.randrange(3))]
            need = alloc.pages_for(len(prompt) + 3)
            if need <= alloc.total:
                r = Request(f"r{len(reqs)}", prompt, rng.randrange(1, 4), float(step))
                reqs.append(r)
                sched.add(r)
        if sched.running and rng.random() < 0.05:  # an abort
            sched.finish(rng.choice(sched.running), RequestStatus.FINISHED_ABORTED)
        if sched.has_schedulable():
            plan = sched.schedule()
            apply_plan(sched, plan, sample_token=rng.randrange(50))
        for r in list(sched.running):
            if r.num_output_tokens >= r.max_tokens and not r.num_uncomputed:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        alloc.check()
        alloc.check_holders([r.page_ids for r in sched.running])
        # A shared page holds the same tokens for every holder (identical history up to it).
        seen: dict[int, tuple] = {}
        for r in sched.running:
            for j, b in enumerate(r.page_ids[:r.num_computed // page]):
                prefix = tuple(r.all_token_ids[:(j + 1) * page])
                assert seen.setdefault(b, prefix) == prefix
        assert all(not r.page_ids for r in sched.waiting)
    for r in list(sched.running) + list(sched.waiting):
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    alloc.check()
    assert alloc.num_allocated == 0 and alloc.num_free == alloc.total


def test_prometheus_prefix_cache_counters_follow_the_engine_totals():
    from jserve.serving.metrics import ServerMetrics

    m = ServerMetrics()
    state = dict(waiting=0, running=1, pages_used=3, pages_free=5, preemptions=0,
                 new_tokens=0)
    m.engine_state(**state, prefix_queried=100, prefix_hits=64, cached_pages=4)
    m.engine_state(**state, prefix_queried=150, prefix_hits=64, cached_pages=6)
    get = m.registry.get_sample_value
    assert get("jserve_prefix_cache_queried_tokens_total") == 150
    assert get("jserve_prefix_cache_hit_tokens_total") == 64
    assert get("jserve_prefix_cache_blocks") == 6


def test_simulator_models_the_cache_from_prefix_identities():
    """Length-only prompts with a shared document: the second ask reuses the first's pages
    (only under caching), and a request of another document shares nothing."""
    import dataclasses

    from jserve.sim.policies import SimConfig, run
    from jserve.sim.trace import TraceRequest

    doc = dict(prefix_id="doc", prefix_tokens=20_000)
    trace = [TraceRequest("ask0", 0.0, 20_100, 8, **doc),
             TraceRequest("ask1", 30.0, 20_050, 8, **doc),
             TraceRequest("other", 60.0, 20_050, 8, prefix_id="other", prefix_tokens=20_000)]

    def ttfts(caching):
        recs = run(trace, "lars", dataclasses.replace(SimConfig(), prefix_caching=caching))
        return {r["request_id"]: r["first_token_s"] - r["arrival_s"] for r in recs}

    off, on = ttfts(False), ttfts(True)
    assert on["ask0"] == pytest.approx(off["ask0"])
    assert on["other"] == pytest.approx(off["other"])
    assert on["ask1"] < off["ask1"] / 10   # 50 uncached tokens against 20,050

"""Deadline-aware policies on constructed cases, driven by the simulator's virtual clock."""
from __future__ import annotations

import dataclasses

import pytest

from jserve.cache.allocator import BlockAllocator
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import DeadlineConfig, DeadlineScheduler
from jserve.scheduler.predictor import LinearPredictor
from jserve.scheduler.request import Request
from jserve.sim import TraceRequest, VirtualClock, simulate

MS_PER_TOKEN = LinearPredictor((0.0, 1e-3, 0.0, 0.0, 0.0, 0.0))  # 1 ms a token, nothing else
CONFIG = DeadlineConfig(t_target=0.05, long_threshold=1000, chunk_granularity=50)  # 50-token steps


def _run(policy, trace, predictor=MS_PER_TOKEN, config=CONFIG, blocks=4096):
    clock = VirtualClock()
    sched = DeadlineScheduler(
        BlockAllocator(blocks + 1, 16), policy=policy, predictor=predictor,
        prefill_cache=PrefillTimeCache(predictor, 20_000, config.t_target),
        max_num_seqs=64, max_num_batched_tokens=4096, max_prefill_seqs=8, config=config,
        clock=clock)
    records = {r["request_id"]: r for r in simulate(sched, predictor, clock, trace, policy)}
    sched.allocator.check()
    assert sched.allocator.num_allocated == 0
    return records


# The paper's case: 10 s of prefill work due at 16 s; two 0.5 s requests due 1 s after t=5.
PAPER = [TraceRequest("long", 0.0, 10_000, 1, ttft_deadline_s=16.0),
         TraceRequest("short-a", 5.0, 500, 1, ttft_deadline_s=1.0),
         TraceRequest("short-b", 5.0, 500, 1, ttft_deadline_s=1.0)]


def _met(rec, trace_req):
    return rec["first_token_s"] <= trace_req.arrival_s + trace_req.ttft_deadline_s + 1e-6


def test_fcfs_convoys_both_short_requests_past_their_deadlines():
    recs = _run("fcfs", PAPER)
    assert recs["long"]["first_token_s"] == pytest.approx(10.0)
    assert not _met(recs["short-a"], PAPER[1]) and not _met(recs["short-b"], PAPER[2])
    assert recs["short-a"]["first_token_s"] == pytest.approx(10.5)


@pytest.mark.parametrize("policy", ["edf", "lrs"])
def test_deadline_policies_preempt_the_long_prefill_and_meet_all_three(policy):
    recs = _run(policy, PAPER)
    assert all(_met(recs[t.request_id], t) for t in PAPER)
    assert recs["long"]["first_token_s"] == pytest.approx(11.0)


def test_lars_as_specified_on_the_paper_case():
    """LARS = slack / total work ranks the long request (0.6) ahead of the fresh shorts (1.0)
    at t=5, so the shorts start only once their own key drops below 0.6 and finish at 6.2 and
    6.25, missing 6.0: the issue expects LARS to meet all three. Pinned here so a change of
    definition is deliberate; see the closing note of the scheduler work."""
    recs = _run("lars", PAPER)
    assert recs["long"]["first_token_s"] == pytest.approx(11.0)
    assert recs["short-a"]["first_token_s"] == pytest.approx(6.2)
    assert recs["short-b"]["first_token_s"] == pytest.approx(6.25)


def test_lars_keys_on_constructed_values():
    clock = VirtualClock(5.0)
    cache = PrefillTimeCache(MS_PER_TOKEN, 20_000, 0.05)
    kw = dict(predictor=MS_PER_TOKEN, prefill_cache=cache, max_num_seqs=8,
              max_num_batched_tokens=4096, max_prefill_seqs=4, clock=clock)
    long = Request("long", [0] * 10_000, 1, 0.0, num_computed=5_000, ttft_deadline=16.0)
    short = Request("short", [0] * 500, 1, 5.0, ttft_deadline=6.0)
    lars = DeadlineScheduler(BlockAllocator(64, 16), policy="lars", **kw)
    assert lars.key(long, 5.0) == pytest.approx((16 - 5 - 5) / 10)   # slack / total work
    assert lars.key(short, 5.0) == pytest.approx((6 - 5 - 0.5) / 0.5)
    rel = DeadlineScheduler(BlockAllocator(64, 16), policy="lars",
                            config=DeadlineConfig(lars_variant="relative_deadline"), **kw)
    assert rel.key(long, 5.0) == pytest.approx(6 / 16)               # slack / relative deadline
    lrs = DeadlineScheduler(BlockAllocator(64, 16), policy="lrs", **kw)
    assert lrs.key(short, 5.0) == pytest.approx(0.5) and lrs.key(long, 5.0) == pytest.approx(6)


def test_default_ttft_deadline_is_k_times_isolated_prefill_with_a_floor():
    clock = VirtualClock()
    cache = PrefillTimeCache(MS_PER_TOKEN, 20_000, 0.05)
    sched = DeadlineScheduler(BlockAllocator(512, 16), policy="edf", predictor=MS_PER_TOKEN,
                              prefill_cache=cache, max_num_seqs=8, max_num_batched_tokens=4096,
                              max_prefill_seqs=4, clock=clock)
    big, tiny = Request("big", [0] * 2000, 1, 0.0), Request("tiny", [0] * 10, 1, 0.0)
    sched.add(big)
    sched.add(tiny)
    assert big.ttft_deadline == pytest.approx(1.5 * 2.0)
    assert tiny.ttft_deadline == pytest.approx(0.5)


def test_space_sharing_leaves_room_for_short_prefills_beside_a_long_one():
    # The long request has lots of slack (rho = 9 > rho_max), so with sharing it takes only
    # half of each iteration and the short request (ranked after it) runs beside it.
    trace = [TraceRequest("long", 0.0, 6_000, 1, ttft_deadline_s=60.0),
             TraceRequest("short", 2.0, 200, 1, ttft_deadline_s=30.0)]
    fine = dataclasses.replace(CONFIG, chunk_granularity=10)
    shared = _run("lars", trace, config=fine)
    alone = _run("lars", trace, config=dataclasses.replace(fine, space_sharing=False))
    # At least half of every 50 ms step (0.2 s of work at <= 2x slowdown), never the whole.
    assert 2.0 + 0.2 < shared["short"]["first_token_s"] <= 2.0 + 0.2 / 0.5 + 0.02
    assert alone["short"]["first_token_s"] == pytest.approx(6.2)
    assert shared["long"]["first_token_s"] == pytest.approx(6.2)
    assert alone["long"]["first_token_s"] == pytest.approx(6.0)

"""Deadline-aware policies on constructed cases, driven by the simulator's virtual clock."""
from __future__ import annotations

import dataclasses

import pytest

from jserve.cache.allocator import PageAllocator
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import DeadlineConfig, DeadlineScheduler
from jserve.scheduler.predictor import LinearPredictor
from jserve.scheduler.request import Request
from jserve.sim import TraceRequest, VirtualClock, simulate

MS_PER_TOKEN = LinearPredictor((0.0, 1e-3, 0.0, 0.0, 0.0, 0.0))  # 1 ms a token, nothing else
# 50-token steps; the paper's rules (quick_first, jserve's own addition, has its own test).
CONFIG = DeadlineConfig(t_target=0.05, long_threshold=1000, chunk_granularity=50,
                        quick_first=0.0)


def _run(policy, trace, predictor=MS_PER_TOKEN, config=CONFIG, blocks=4096, tokens=4096):
    clock = VirtualClock()
    sched = DeadlineScheduler(
        PageAllocator(blocks + 1, 16), policy=policy, predictor=predictor,
        prefill_cache=PrefillTimeCache(predictor, 20_000, config.t_target),
        max_num_seqs=64, max_num_batched_tokens=tokens, max_prefill_seqs=8, config=config,
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


def test_lars_meets_all_three_on_the_paper_case():
    recs = _run("lars", PAPER)
    assert all(_met(recs[t.request_id], t) for t in PAPER)
    assert recs["short-a"]["first_token_s"] == pytest.approx(5.95)
    assert recs["short-b"]["first_token_s"] == pytest.approx(6.0)


@pytest.mark.parametrize("variant,short_a,short_b", [("total_work", 6.2, 6.25),
                                                     ("relative_deadline", 6.1, 6.15)])
def test_lars_variants_that_rank_the_long_request_first_miss_the_paper_case(
        variant, short_a, short_b):
    """Dividing by the total work (0.6 against the shorts' 1.0 at t=5) or by the relative
    deadline (0.375 against 0.5) puts the long request first, so the shorts start only when
    their own key falls below it and miss 6.0: kept as switches, not as the default. With
    due requests first (the default) short A, due at 5.55, goes first and makes it; B
    still misses (the ranking started them too late for both)."""
    config = dataclasses.replace(CONFIG, lars_variant=variant)
    recs = _run("lars", PAPER, config=dataclasses.replace(config, due_first=False))
    assert recs["short-a"]["first_token_s"] == pytest.approx(short_a)
    assert recs["short-b"]["first_token_s"] == pytest.approx(short_b)
    recs = _run("lars", PAPER, config=config)
    assert recs["short-a"]["first_token_s"] == pytest.approx(6.0)
    assert recs["short-b"]["first_token_s"] == pytest.approx(short_b)


# A long prefill already late (10 s of work due at 5 s) and a 0.5 s short due 1.02 s after
# it arrives at t=2.
LATE_LONG = [TraceRequest("long", 0.0, 10_000, 1, ttft_deadline_s=5.0),
             TraceRequest("short", 2.0, 500, 1, ttft_deadline_s=1.02)]


def test_lars_serves_a_due_short_before_a_late_long_prefill():
    """The paper's LARS ranks the late long request by its negative slack over its remaining
    work (-5 s / 7.5 s at t=2.5): a short with any slack left ranks after it and waits until
    its own key is as negative, so it misses (first token ~3.4 s against 3.02 s). With due
    requests first it waits only while it has more than one iteration (50 ms) of slack, then
    runs at once and meets its deadline; the late request loses 0.5 s and is late anyway."""
    paper = _run("lars", LATE_LONG, config=dataclasses.replace(CONFIG, due_first=False))
    assert paper["short"]["first_token_s"] > 3.02 + 0.3
    recs = _run("lars", LATE_LONG)
    assert 3.0 - 1e-6 <= recs["short"]["first_token_s"] <= 3.02
    assert recs["long"]["first_token_s"] == pytest.approx(10.5)


QUICK_SHORT = [TraceRequest("long", 0.0, 10_000, 1, ttft_deadline_s=5.0),
               TraceRequest("short", 2.0, 100, 1, ttft_deadline_s=1.0)]


def test_lars_serves_a_quick_short_at_once():
    """A short whose whole prefill (0.1 s) fits in quick_first x t_target (4 x 50 ms) ranks
    with the due requests as soon as it arrives, though it has 0.9 s of slack: its first
    token comes two 50 ms iterations after arrival. Without the rule it waits until it is
    due (slack under one iteration), near its deadline. The long request, late either way,
    finishes at the same time: the same work, in another order."""
    assert DeadlineConfig().quick_first == 4.0  # the default
    quick = _run("lars", QUICK_SHORT, config=dataclasses.replace(CONFIG, quick_first=4.0))
    slow = _run("lars", QUICK_SHORT)
    assert quick["short"]["first_token_s"] <= 2.0 + 0.1 + 0.05 + 1e-9
    assert slow["short"]["first_token_s"] >= 2.0 + 0.85
    assert slow["short"]["first_token_s"] <= 3.0 + 1e-9  # still within its deadline
    assert quick["long"]["first_token_s"] == pytest.approx(slow["long"]["first_token_s"])


def test_lars_order_of_due_late_and_other_requests():
    """One step's ranking, with keys: a due request (slack in [0, t_target)) before a late
    one, and a late one before one with slack to spare; due ones by least remaining work,
    late ones in the paper's order (the most negative slack over remaining work first)."""
    clock = VirtualClock(2.5)
    cache = PrefillTimeCache(MS_PER_TOKEN, 20_000, 0.05)
    kw = dict(predictor=MS_PER_TOKEN, prefill_cache=cache, max_num_seqs=8,
              max_num_batched_tokens=4096, max_prefill_seqs=4, clock=clock, config=CONFIG)
    reqs = [Request("late-long", [0] * 10_000, 1, 0.0, num_computed=2_500, ttft_deadline=5.0),
            Request("late-mid", [0] * 2_000, 1, 1.0, ttft_deadline=4.0),   # -0.5 s / 2 s
            Request("due-big", [0] * 400, 1, 2.0, ttft_deadline=2.93),     # slack 0.03 s
            Request("due-small", [0] * 100, 1, 2.4, ttft_deadline=2.64),   # slack 0.04 s
            Request("spare", [0] * 500, 1, 2.5, ttft_deadline=3.5)]        # slack 0.5 s
    lars = DeadlineScheduler(PageAllocator(2048, 16), policy="lars", **kw)
    paper = DeadlineScheduler(PageAllocator(2048, 16), policy="lars", **{
        **kw, "config": dataclasses.replace(CONFIG, due_first=False)})
    for sched in (lars, paper):
        for r in reqs:
            sched.add(r)
    order = [r.request_id for r in lars._candidates(2.5, True, set())[0]]
    assert order == ["due-small", "due-big", "late-long", "late-mid", "spare"]
    assert [r.request_id for r in paper._candidates(2.5, True, set())[0]] == [
        "late-long", "late-mid", "due-big", "due-small", "spare"]
    assert lars.key(reqs[0], 2.5) == pytest.approx(-0.4)  # -5/7.5 mapped to rho / (1 - rho)
    assert paper.key(reqs[0], 2.5) == pytest.approx(-5 / 7.5)
    assert lars.key(reqs[4], 2.5) == paper.key(reqs[4], 2.5) == pytest.approx(1.0)


def test_edf_starves_a_long_prefill_under_a_steady_stream_then_convoys():
    """Shorts (0.2 s of work each, due 0.5 s after arrival) every 0.4 s beside one 5 s
    prefill due at 7.5 s: EDF serves every short first while their deadlines are earlier,
    so the long request gets only the gaps; once it holds the earliest deadline it runs
    alone, finishes late, and the shorts arriving meanwhile queue behind it and miss."""
    trace = [TraceRequest("long", 0.0, 5000, 1)]
    trace += [TraceRequest(f"s{i}", round(0.1 + 0.4 * i, 4), 200, 1) for i in range(50)]
    recs = _run("edf", trace)
    assert recs["long"]["first_token_s"] > 7.5 + 1.0          # starved past its deadline
    missed = [i for i in range(50) if not _met(recs[f"s{i}"], dataclasses.replace(
        trace[i + 1], ttft_deadline_s=0.5))]
    assert missed == list(range(18, 23))                       # the convoy behind it
    # Every short before the long request became most urgent met its deadline.
    assert all(recs[f"s{i}"]["first_token_s"] <= 0.1 + 0.4 * i + 0.5 + 1e-6 for i in range(18))


def test_lars_keys_on_constructed_values():
    clock = VirtualClock(5.0)
    cache = PrefillTimeCache(MS_PER_TOKEN, 20_000, 0.05)
    kw = dict(predictor=MS_PER_TOKEN, prefill_cache=cache, max_num_seqs=8,
              max_num_batched_tokens=4096, max_prefill_seqs=4, clock=clock)
    long = Request("long", [0] * 10_000, 1, 0.0, num_computed=5_000, ttft_deadline=16.0)
    short = Request("short", [0] * 500, 1, 5.0, ttft_deadline=6.0)
    lars = DeadlineScheduler(PageAllocator(64, 16), policy="lars", **kw)
    assert lars.key(long, 5.0) == pytest.approx((16 - 5 - 5) / 5)    # slack / remaining work
    assert lars.key(short, 5.0) == pytest.approx((6 - 5 - 0.5) / 0.5)
    total = DeadlineScheduler(PageAllocator(64, 16), policy="lars",
                              config=DeadlineConfig(lars_variant="total_work"), **kw)
    assert total.key(long, 5.0) == pytest.approx((16 - 5 - 5) / 10)  # slack / total work
    rel = DeadlineScheduler(PageAllocator(64, 16), policy="lars",
                            config=DeadlineConfig(lars_variant="relative_deadline"), **kw)
    assert rel.key(long, 5.0) == pytest.approx(6 / 16)               # slack / relative deadline
    lrs = DeadlineScheduler(PageAllocator(64, 16), policy="lrs", **kw)
    assert lrs.key(short, 5.0) == pytest.approx(0.5) and lrs.key(long, 5.0) == pytest.approx(6)


def test_default_ttft_deadline_is_k_times_isolated_prefill_with_a_floor():
    clock = VirtualClock()
    cache = PrefillTimeCache(MS_PER_TOKEN, 20_000, 0.05)
    sched = DeadlineScheduler(PageAllocator(512, 16), policy="edf", predictor=MS_PER_TOKEN,
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
    # Without sharing the short waits until the long's key (its slack over a shrinking
    # remainder) rises past its own, near the end of the long prefill.
    assert alone["short"]["first_token_s"] == pytest.approx(6.1)
    assert shared["long"]["first_token_s"] == pytest.approx(6.2)
    assert alone["long"]["first_token_s"] == pytest.approx(6.2)


def test_priority_ranks_before_the_policy_key_and_tpot_slo_caps_the_budget():
    clock = VirtualClock()
    sched = DeadlineScheduler(
        PageAllocator(4097, 16), policy="edf", predictor=MS_PER_TOKEN,
        prefill_cache=PrefillTimeCache(MS_PER_TOKEN, 20_000, 0.05), max_num_seqs=64,
        max_num_batched_tokens=4096, max_prefill_seqs=8,
        config=dataclasses.replace(CONFIG, chunk_granularity=1), clock=clock)
    tight = Request("tight", [0] * 8, 4, 0.0, tpot_slo=0.04, priority=-2)
    first = Request("first", [0] * 400, 1, 0.0)
    second = Request("second", [0] * 400, 1, 0.0, priority=-1)  # same deadline, later in line
    for r in (first, second, tight):
        sched.add(r)
    plan = sched.schedule()
    assert [(c.request_id, c.num_tokens) for c in plan.prefills] == [("tight", 8), ("second", 42)]
    sched.update(plan, [0])  # tight's first token: it decodes from now on
    plan = sched.schedule()
    # 40 ms, not 50: one decode and 39 tokens of "second".
    assert [c.request_id for c in plan.decodes] == ["tight"]
    assert [(c.request_id, c.num_tokens) for c in plan.prefills] == [("second", 39)]
    # Under memory pressure the worst priority goes first, whatever its key.
    assert sched._victim() is second  # priority -1 against tight's -2
    tight.priority = 5
    assert sched._victim() is tight


@pytest.mark.parametrize("policy", ["edf", "lrs", "lars"])
@pytest.mark.parametrize("share, chunk", [(0.5, 25), (0.2, 10), (0.0, 0)])
def test_a_tiny_tpot_slo_cannot_stop_other_prefills(policy, share, chunk):
    """The progress rule: a decode asking for 1 us per token shortens the iteration only to
    its own decode (1 ms) plus prefill_share x t_target (50 ms), so a waiting prefill still
    gets share x 50 tokens a step; with share 0 it would get none while the decode runs."""
    clock = VirtualClock()
    config = dataclasses.replace(CONFIG, chunk_granularity=1, prefill_share=share)
    sched = DeadlineScheduler(
        PageAllocator(4097, 16), policy=policy, predictor=MS_PER_TOKEN,
        prefill_cache=PrefillTimeCache(MS_PER_TOKEN, 20_000, 0.05), max_num_seqs=64,
        max_num_batched_tokens=4096, max_prefill_seqs=8, config=config, clock=clock)
    hostile = Request("hostile", [0] * 8, 1000, 0.0, tpot_slo=1e-6)
    sched.add(hostile)
    sched.update(sched.schedule(), [0])  # its prefill, then it decodes
    victim = Request("victim", [0] * 600, 1, 0.0)
    sched.add(victim)
    plan = sched.schedule()
    assert sched.iteration_budget(plan.__class__(plan.decodes, ())) == pytest.approx(
        0.001 + share * 0.05)
    assert [c.request_id for c in plan.decodes] == ["hostile"]
    assert [(c.request_id, c.num_tokens) for c in plan.prefills] == (
        [("victim", chunk)] if chunk else [])
    with pytest.raises(ValueError, match="prefill_share"):
        DeadlineConfig(prefill_share=1.5)


@pytest.mark.parametrize("policy", ["lars", "edf", "lrs"])
def test_a_prefill_alone_runs_a_whole_chunk_and_shares_the_budget_otherwise(policy):
    """full_chunk_alone: with no decode in the batch there is nothing for t_target to protect,
    so the first prefill takes the whole token budget (256) rather than the 49 tokens
    (7-token granules) that fit the 50 ms budget at 1 ms a token; beside a decode it is cut
    to the budget again."""
    def scheduler(full: bool) -> DeadlineScheduler:
        config = dataclasses.replace(CONFIG, full_chunk_alone=full, chunk_granularity=7)
        return DeadlineScheduler(
            PageAllocator(4097, 16), policy=policy, predictor=MS_PER_TOKEN,
            prefill_cache=PrefillTimeCache(MS_PER_TOKEN, 20_000, config.t_target),
            max_num_seqs=64, max_num_batched_tokens=256, max_prefill_seqs=8, config=config,
            clock=VirtualClock())

    def chunks(plan):
        return {c.request_id: c.num_tokens for c in plan.prefills}

    for full, alone in ((True, 256), (False, 49)):
        sched = scheduler(full)
        sched.add(Request("long", list(range(1000)), 4, 0.0))
        assert chunks(sched.schedule()) == {"long": alone}
    # Two prefills and no decode: the first in policy order runs a whole chunk, the other
    # waits; off, they share one 50 ms budget.
    for full, sizes in ((True, [256]), (False, [49])):
        sched = scheduler(full)
        sched.add(Request("long", list(range(1000)), 4, 0.0))
        sched.add(Request("other", list(range(2000, 2600)), 4, 0.0))
        sizes_now = sorted(chunks(sched.schedule()).values())
        assert sizes_now == sizes if full else sum(sizes_now) == sizes[0]
    # Beside a decode: the budget protects it (1 ms for the decode row, 49 for the chunk).
    sched = scheduler(True)
    sched.add(Request("short", list(range(10)), 4, 0.0))
    plan = sched.schedule()
    assert chunks(plan) == {"short": 10}
    sched.update(plan, [7])
    sched.add(Request("long", list(range(1000)), 4, 0.0))
    plan = sched.schedule()
    assert [c.request_id for c in plan.decodes] == ["short"]
    assert chunks(plan) == {"long": 49}
    sched.allocator.check()


# A CPU's shape (issue 56): a 35 ms step before any token, 1.6 ms a token; a 64-token prompt
# alone takes 0.14 s, and a decode step leaves no 32-token granule inside the 50 ms budget.
CPU_STEP = LinearPredictor((0.035, 1.6e-3, 0.0, 0.0, 0.0, 0.0))
CPU_CONFIG = DeadlineConfig(t_target=0.05, full_chunk_alone=True)
CPU_CONVOY = [TraceRequest("doc", 0.0, 8000, 16)] + [
    TraceRequest(f"short-{i}", 0.5, 64, 16) for i in range(8)]


@pytest.mark.parametrize("policy", ["lars", "edf", "lrs"])
def test_short_prompts_are_packed_into_a_few_steps_when_the_budget_holds_none(policy):
    """Eight 64-token prompts behind an 8,000-token document, at most 256 tokens a step.
    Without packing (quick_first 0) each short waits for the one before it to finish
    decoding (nothing fits beside a decode), first tokens 0.7 s apart; packed, whole
    prompts share steps: four, three and one, the last first token 1.4 s after arrival, and
    the document is done sooner as well (the same work in fewer steps)."""
    packed = _run(policy, CPU_CONVOY, predictor=CPU_STEP, config=CPU_CONFIG, tokens=256)
    alone = _run(policy, CPU_CONVOY, predictor=CPU_STEP, tokens=256,
                 config=dataclasses.replace(CPU_CONFIG, quick_first=0.0))
    ttft = {name: sorted(r[f"short-{i}"]["first_token_s"] - 0.5 for i in range(8))
            for name, r in (("packed", packed), ("alone", alone))}
    assert len(set(ttft["alone"])) == 8 and ttft["alone"][-1] > 5.0
    assert [ttft["packed"].count(t) for t in sorted(set(ttft["packed"]))] == [4, 3, 1]
    assert ttft["packed"][-1] < 1.4
    assert packed["doc"]["first_token_s"] < alone["doc"]["first_token_s"]


@pytest.mark.parametrize("policy", ["lars", "edf"])
def test_a_packed_prompt_makes_no_prompt_of_its_step_miss_a_deadline_it_would_meet(policy):
    """A decode runs, so no granule fits beside it; two 64-token prompts arrive. With A due
    0.2 s after arrival, the step with A alone ends in time and one with B too would not:
    B waits one step. With A's deadline far off both share the step."""
    decode = TraceRequest("decode", 0.0, 1, 200)
    tight = [decode, TraceRequest("a", 0.2, 64, 1, ttft_deadline_s=0.2),
             TraceRequest("b", 0.2, 64, 1, ttft_deadline_s=2.0)]
    recs = _run(policy, tight, predictor=CPU_STEP, config=CPU_CONFIG, tokens=256)
    assert recs["a"]["first_token_s"] <= 0.4 < recs["b"]["first_token_s"]
    loose = [decode] + [dataclasses.replace(t, ttft_deadline_s=2.0) for t in tight[1:]]
    recs = _run(policy, loose, predictor=CPU_STEP, config=CPU_CONFIG, tokens=256)
    assert recs["a"]["first_token_s"] == recs["b"]["first_token_s"]

"""Speculative decoding's host side, without JAX: the speculative_config dict, the n-gram
proposer, verification and KV rollback in ``SchedulerBase.update``, and drafts under the
token and time budgets (a due prefill is never delayed by them, a constructed LARS case)."""
from __future__ import annotations

import numpy as np
import pytest

from jserve.cache.allocator import PageAllocator
from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import DeadlineConfig, DeadlineScheduler
from jserve.scheduler.predictor import LinearPredictor
from jserve.scheduler.registry import Limits, SchedulerSpec, build_scheduler
from jserve.scheduler.request import Request
from jserve.speculative import SpeculativeConfig, propose_ngram


# -- configuration ---------------------------------------------------------------------
def test_speculative_config_reads_vllm_dicts_and_json():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) \
        == ("ngram", 4, 1, 4)
    c = SpeculativeConfig.parse('{"model": "tiny-tasks", "num_speculative_tokens": 2}')
    assert (c.method, c.model) == ("draft_model", "tiny-tasks")
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 2}).prompt_lookup_min == 1


@pytest.mark.parametrize("bad,words", [
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_min (3) > prompt_lookup_max (2)"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown keys ['typo']"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_config_is_refused_by_name(bad, words):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse(bad)
    assert words in str(e.value)


# -- the n-gram proposer -----------------------------------------------------------------
def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
    h = [np.array(x) for x in ([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3],  # 3-gram: after 7
                               [4, 5, 6, 4, 5],                          # 2-gram
                               [1, 2, 3, 4],                             # nothing repeats
                               [7, 7, 7, 7, 7])]                         # a loop
    got = propose_ngram(h, [3, 4, 4, 3], n_min=1, n_max=3)
    # A continuation that runs into the suffix goes on with the draft (the pattern repeats).
    assert [g.tolist() for g in got] == [[7, 8, 5], [6, 4, 5, 6], [], [7, 7, 7]]
    # n_min above the longest repeat: nothing; k=0: nothing.
    assert propose_ngram(h[1:2], [4], n_min=3, n_max=3)[0].tolist() == []
    assert propose_ngram(h[:1], [0], n_min=1, n_max=3)[0].tolist() == []


# -- verification and rollback -------------------------------------------------------------
def _decoding(sched, prompt_len=20, rid="r"):
    """A request admitted, prefilled and given its first token (decoding next)."""
    req = Request(rid, list(range(3, 3 + prompt_len)), 64, 0.0)
    sched.add(req)
    plan = sched.schedule()
    sched.update(plan, [100] * (plan.num_decode_rows + sum(c.samples for c in plan.prefills)))
    assert req.is_decode
    return req


def test_update_accepts_the_agreeing_prefix_and_frees_the_rejected_pages():
    alloc = PageAllocator(64, 4)
    sched = build_scheduler(SchedulerSpec("sarathi", Limits(4, 64, 2)), alloc)
    req = _decoding(sched, prompt_len=11)  # 12 tokens: 3 full pages of 4
    req.draft_ids = [50, 51, 52, 53, 54, 55]
    plan = sched.schedule()
    (c,) = plan.decodes
    assert (c.start, c.num_tokens, c.drafts) == (11, 7, (50, 51, 52, 53, 54, 55))
    assert len(req.page_ids) == 5 and req.all_token_ids[-6:] == [50, 51, 52, 53, 54, 55]
    alloc.check_holders(sched.page_holders())
    # Samples agree with the first two drafts; the third sample replaces draft 52.
    out = sched.update(plan, [50, 51, 77, 0, 0, 0, 0])
    assert [i for i, _ in out] == [0, 1, 2]
    assert req.all_token_ids[11:] == [100, 50, 51, 77] and req.num_computed == 14
    assert len(req.page_ids) == 4 and req.is_decode  # KV of 14 tokens: pages 4
    assert (req.num_drafted, req.num_accepted) == (6, 2)
    assert (sched.num_draft_tokens, sched.num_accepted_tokens, sched.num_draft_steps) \
        == (6, 2, 1)
    alloc.check()
    alloc.check_holders(sched.page_holders())
    # All accepted: the bonus token follows the last draft.
    req.draft_ids = [5, 6]
    plan = sched.schedule()
    sched.update(plan, [5, 6, 9])
    assert req.all_token_ids[-4:] == [77, 5, 6, 9] and req.num_computed == 17
    sched.finish(req, req.status.FINISHED_STOPPED)
    assert alloc.num_allocated == 0


def test_abort_while_drafts_are_in_flight_frees_every_page():
    alloc = PageAllocator(64, 4)
    sched = build_scheduler(SchedulerSpec("sarathi", Limits(4, 64, 2)), alloc)
    req = _decoding(sched, prompt_len=11)
    req.draft_ids = [1, 2, 3, 4]
    plan = sched.schedule()
    sched.finish(req, req.status.FINISHED_ABORTED)
    assert sched.update(plan, [1, 2, 3, 4, 5]) == []
    alloc.check()
    assert alloc.num_allocated == 0


def test_drafts_take_only_the_token_budget_and_kv_left():
    """Budget 12 tokens: two decodes (2) and a 6-token prefill chunk leave 4 for drafts,
    given in decode order; a request whose KV cannot grow gets none (no preemption)."""
    alloc = PageAllocator(9, 4)  # 8 usable pages
    sched = build_scheduler(SchedulerSpec("sarathi", Limits(4, 12, 2)), alloc)
    a, b = _decoding(sched, 7, "a"), _decoding(sched, 7, "b")  # 2 pages each
    sched.add(Request("p", list(range(6)), 4, 0.0))
    a.draft_ids, b.draft_ids = [1, 2, 3], [4, 5, 6]
    plan = sched.schedule()
    assert [c.drafts for c in plan.decodes] == [(1, 2, 3), (4,)]
    assert [c.num_tokens for c in plan.prefills] == [6] and plan.num_tokens == 12
    sched.update(plan, [1, 9, 0, 0, 4, 8, 7])  # a, b: 1 accepted each; p: its first token
    alloc.check_holders(sched.page_holders())
    # The pool full: pages for drafts are not taken by preempting anyone.
    taken = alloc.allocate(alloc.num_free_in(0))
    a.draft_ids = list(range(40, 48))
    a_room = len(a.page_ids) * 4 - a.num_computed - 1
    plan = sched.schedule()
    assert len(plan.decodes[0].drafts) == a_room and not plan.preempted
    alloc.free(taken)


# -- the time budget -----------------------------------------------------------------
MS_PER_TOKEN = LinearPredictor((0.0, 1e-3, 0.0, 0.0, 0.0, 0.0))


def _lars(clock):
    config = DeadlineConfig(t_target=0.05, chunk_granularity=8, quick_first=0.0)
    return DeadlineScheduler(
        PageAllocator(512, 16), policy="lars", predictor=MS_PER_TOKEN,
        prefill_cache=PrefillTimeCache(MS_PER_TOKEN, 4096, config.t_target),
        max_num_seqs=16, max_num_batched_tokens=256, max_prefill_seqs=4, config=config,
        clock=clock)


@pytest.mark.parametrize("offers", [False, True])
def test_under_lars_a_due_short_prefill_is_not_delayed_by_drafts(offers):
    """50 ms budget at 1 ms a token: 8 decodes (8 ms) and a 40-token prefill due now
    (its deadline is less than one budget away) fill 48 ms. With 8 x 4 drafts offered the
    prefill still gets its whole 40 tokens this step and the drafts shrink to the 2 tokens
    left; with the prefill gone, every draft fits."""
    now = [0.0]
    sched = _lars(lambda: now[0])
    decoding = []
    for i in range(8):
        req = Request(f"d{i}", list(range(3, 19)), 64, 0.0, ttft_deadline=100.0)
        sched.add(req)
        decoding.append(req)
    while not all(r.is_decode for r in decoding):
        plan = sched.schedule()
        sched.update(plan, [7] * (len(plan.decodes) + len(plan.prefills)))
    now[0] = 1.0
    short = Request("due", list(range(40)), 4, 1.0, ttft_deadline=1.045)
    sched.add(short)
    if offers:
        for r in decoding:
            r.draft_ids = [1, 2, 3, 4]
    plan = sched.schedule()
    assert [(c.request_id, c.num_tokens) for c in plan.prefills] == [("due", 40)]
    assert MS_PER_TOKEN.predict(plan) <= 0.05 + 1e-12
    assert plan.num_draft_tokens == (2 if offers else 0)
    sched.update(plan, [9] * (plan.num_decode_rows + 1))
    for r in decoding:
        r.draft_ids = [1, 2, 3, 4]
    plan = sched.schedule()
    assert not plan.prefills and plan.num_draft_tokens == 32
    for r in decoding:
        assert r.all_token_ids[-1] != 1  # (the verification of the previous step's drafts)
    sched.allocator.check_holders(sched.page_holders())


def test_base_scheduler_has_no_time_budget_for_drafts():
    assert SchedulerBase._drafts_fit(None, None) is True


def _lookup_by_hand(h: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The rule spelled out: largest n first, latest earlier occurrence, copied on."""
    for n in range(min(n_max, len(h) - 1), n_min - 1, -1):
        for s in range(len(h) - n - 1, -1, -1):
            if h[s:s + n] == h[len(h) - n:]:
                seq = h[s + n:]
                return [seq[j % len(seq)] for j in range(k)]
    return []


def test_ngram_batch_agrees_with_the_rule_on_random_histories():
    rng = np.random.default_rng(0)
    cases = [(rng.integers(0, 4, rng.integers(1, 40)).tolist(), int(rng.integers(0, 5)))
             for _ in range(200)]
    for n_min, n_max in ((1, 4), (2, 3), (3, 5)):
        got = propose_ngram([np.array(h) for h, _ in cases], [k for _, k in cases],
                            n_min, n_max)
        for (h, k), g in zip(cases, got):
            assert g.tolist() == _lookup_by_hand(h, k, n_min, n_max), (h, k)


def test_cli_reads_the_speculative_config_json_and_refuses_a_bad_one(capsys):
    import argparse

    from jserve.flags.args import add_engine_args, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    a = parser.parse_args(["--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_kwargs(a)["speculative_config"] == SpeculativeConfig(
        num_speculative_tokens=3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "medusa"}'])
    assert "'medusa' is not supported" in capsys.readouterr().err


def test_speculator_proposes_only_for_requests_that_may_speculate():
    """Drafts for decodes only, capped by max_tokens; none for an opted-out or penalised
    request, one still under min_tokens, or anyone while the batch is over
    ``disable_by_batch_size``."""
    from types import SimpleNamespace

    from jserve.sampling.params import SamplingParams
    from jserve.speculative.speculator import Speculator

    alloc = PageAllocator(64, 4)
    sched = build_scheduler(SchedulerSpec("sarathi", Limits(8, 64, 8)), alloc)
    kinds = {"plain": SamplingParams(), "off": SamplingParams(speculative=False),
             "penalised": SamplingParams(frequency_penalty=0.5),
             "min_tokens": SamplingParams(min_tokens=5, max_tokens=16),
             "short": SamplingParams(max_tokens=3)}
    reqs = {}
    for name, p in kinds.items():
        req = Request(name, [1, 2, 3, 1, 2], p.max_tokens, 0.0,
                      payload=SimpleNamespace(params=p))
        sched.add(req)
        reqs[name] = req
    plan = sched.schedule()
    sched.update(plan, [3] * len(plan.prefills))  # each now ends ... 1 2 3: drafts "1 2 3"
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), 512, sched)
    spec.propose(sched)
    assert {n: r.draft_ids for n, r in reqs.items()} == {
        "plain": [1, 2, 3, 1], "off": [], "penalised": [], "min_tokens": [], "short": [1]}
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=4),
                      512, sched)
    spec.propose(sched)
    assert all(not r.draft_ids for r in reqs.values())


def test_failing_windows_pause_speculation_for_growing_stretches():
    from types import SimpleNamespace

    from jserve.sampling.params import SamplingParams
    from jserve.speculative.speculator import Speculator

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, acceptance_window=8,
                                        min_acceptance_rate=0.25), 512, None)
    req = SimpleNamespace(request_id="r", payload=SimpleNamespace(params=SamplingParams()),
                          num_output_tokens=10, num_drafted=0, num_accepted=0)

    def at(out, drafted, accepted):
        req.num_output_tokens, req.num_drafted, req.num_accepted = out, drafted, accepted
        return spec.speculates(req)

    assert at(10, 4, 0)                 # window not full yet
    assert not at(12, 8, 1)             # 1/8 < 25%: paused for 8 output tokens
    assert not at(19, 8, 1) and at(20, 8, 1)
    assert at(30, 16, 5)                # 4/8 accepted: the window passes
    assert not at(33, 24, 6)            # 1/8: paused again, now for 16 tokens
    assert not at(48, 24, 6) and at(49, 24, 6)


def test_a_paused_request_resumes_once_a_host_only_proposal_comes_true():
    """While paused, prompt lookup runs on the host alone: a proposal whose k tokens all come
    true (the output starts quoting) ends the pause at once; one that fails does not."""
    from types import SimpleNamespace

    from jserve.sampling.params import SamplingParams
    from jserve.speculative.speculator import Speculator, _Acceptance

    alloc = PageAllocator(64, 4)
    sched = build_scheduler(SchedulerSpec("sarathi", Limits(4, 64, 2)), alloc)
    doc = [10, 11, 12, 13, 14, 15, 16]
    req = Request("r", doc + [20, 21], 64, 0.0, payload=SimpleNamespace(
        params=SamplingParams(max_tokens=64)))
    sched.add(req)
    plan = sched.schedule()
    sched.update(plan, [22])  # the answer so far: 22 (it does not quote yet)
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                        prompt_lookup_max=2), 512, sched)
    a = spec._acceptance["r"] = _Acceptance(resume_at=40, pause=32)  # a window failed

    def step(token):
        spec.propose(sched)
        assert req.draft_ids == []  # paused: nothing goes to the device
        sched.update(sched.schedule(), [token])

    # Free text: at "... 12" the lookup proposes "13 14 15"; 30 comes, so no resume.
    for t in (12, 30, 31, 12):
        step(t)
    assert a.resume_at == 40 and not spec.speculates(req)
    # Quoting: at "12 13" it proposes "14 15 16", which comes true: drafts at once.
    for t in (13, 14, 15, 16):
        step(t)
    assert a.resume_at == 40
    spec.propose(sched)  # sees "14 15 16" came: the pause ends
    assert a.resume_at <= req.num_output_tokens < 40
    spec.propose(sched)
    assert req.draft_ids == [20, 21, 22]  # what followed "15 16" in the document
    alloc.check_holders(sched.page_holders())


def test_a_budgeted_ngram_index_finds_new_matches_at_once_and_old_ones_soon():
    """A long prompt is indexed ``budget`` positions a proposal, newest first: a match among
    the newest is proposed at once, one only at the start once indexing reaches it; then the
    proposals are the unbounded rule's."""
    from jserve.speculative.ngram import NgramIndex

    def index(h, budget):
        ix = NgramIndex(1, 2, budget)
        ix.extend(h)
        return ix

    recent = list(range(100, 300)) + [295, 296]
    assert index(recent, 16).propose(4).tolist() == [297, 298, 299, 295]
    old = [7, 8, 9] + list(range(100, 300)) + [7, 8]
    ix = index(old, 16)
    proposals = [ix.propose(4).tolist() for _ in range(len(old) // 16 + 2)]
    assert proposals[0] == [] and proposals[-1] == [9, 100, 101, 102]
    assert proposals[-1] == propose_ngram([old], [4], 1, 2)[0].tolist()
    # A key seen again later keeps its latest position: 150 follows the later 8, not the first.
    ix = index(old[:-2] + [8, 150, 1, 2, 3] + [8], 16)
    for _ in range(len(old) // 16 + 2):
        got = ix.propose(2).tolist()
    assert got == [150, 1]

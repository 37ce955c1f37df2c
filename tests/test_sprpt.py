"""SPRPT with limited preemption: the preemption window, the ordering, the victim choice (on
constructed requests, no device), and an engine run with a real probe: no KV leak and the
same greedy tokens as without preemption."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import apply_plan
from jserve.cache.allocator import PageAllocator
from jserve.probe import LengthBins, train_probe
from jserve.sampling.params import SamplingParams
from jserve.scheduler import Limits, Request, RequestStatus, SchedulerSpec, build_scheduler
from jserve.scheduler.sprpt import SPRPTScheduler
from llm_helpers import run_checked, small_llm


def _sched(c=0.8, seqs=2, blocks=64, budget=64, page_size=4, fallback=None):
    spec = SchedulerSpec("sprpt", Limits(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                         max_prefill_seqs=4),
                         sprpt_c=c, fallback_remaining=fallback)
    return build_scheduler(spec, PageAllocator(blocks + 1, page_size))


def _req(rid, prompt_len=4, t=0.0, first=None, remaining=None, generated=0):
    r = Request(rid, list(range(1, prompt_len + 1)), 512, float(t))
    r.all_token_ids += [5] * generated
    r.first_prediction = first
    r.predicted_remaining = remaining if remaining is not None else first
    return r




@pytest.mark.parametrize("c, generated, allowed", [
    (0.8, 0, True), (0.8, 8, True), (0.8, 9, False), (0.8, 40, False),
    (1.0, 10, True), (1.0, 11, False),
    (0.0, 0, False), (0.0, 5, False),
    (0.5, 5, True), (0.5, 6, False)])
def test_preemption_window_is_generated_at_most_c_times_first_prediction(c, generated, allowed):
    s = _sched(c=c)
    assert s.preemptable(_req("a", first=10.0, generated=generated)) is allowed


def test_window_before_any_prediction_and_bad_c():
    assert _sched(c=0.8).preemptable(_req("a"))      # still prefilling: generated 0
    assert not _sched(c=0.0).preemptable(_req("a"))
    with pytest.raises(ValueError):
        _sched(c=-0.1)


def test_shortest_predicted_waiting_request_is_admitted_first():
    s = _sched(seqs=1, fallback=100.0)
    long_, short, unknown = _req("long", first=300.0), _req("short", t=1, first=20.0), \
        _req("unknown", t=2)
    for r in (long_, unknown, short):
        s.add(r)
    plan = s.schedule()
    assert [c.request_id for c in plan.prefills] == ["short"]
    assert s.remaining(unknown) == 100.0  # the fallback before a prediction
    assert _sched(seqs=1).remaining(unknown) == 512  # no fallback given: max_tokens


def test_full_batch_preempts_the_preemptable_request_with_the_largest_prediction():
    s = _sched(seqs=2)
    a, b = _req("a", first=50.0), _req("b", t=1, first=30.0)
    for r in (a, b):
        s.add(r)
    apply_plan(s, s.schedule())
    assert s.running == [b, a]  # admitted shortest first
    short = _req("short", t=2, first=5.0)
    s.add(short)
    plan = s.schedule()
    assert plan.preempted == ("a",)
    assert a.status is RequestStatus.PREEMPTED and a in s.waiting and not a.page_ids
    assert [c.request_id for c in plan.prefills] == ["short"]
    assert [c.request_id for c in plan.decodes] == ["b"]
    assert s.allocator.num_allocated == sum(len(r.page_ids) for r in s.running)


def test_a_request_past_its_window_is_not_preempted_the_next_largest_is():
    s = _sched(seqs=2, c=0.8)
    a, b = _req("a", first=10.0), _req("b", t=1, first=30.0)
    for r in (a, b):
        s.add(r)
    apply_plan(s, s.schedule())
    a.all_token_ids += [5] * 8  # a has generated 9 > 0.8 x 10: out of its window
    a.num_computed = len(a.all_token_ids) - 1
    s.allocator.free(a.page_ids)
    a.page_ids = s.allocator.allocate(s.allocator.pages_for(len(a.all_token_ids)))
    a.predicted_remaining = 40.0  # now the largest prediction, but protected
    s.add(_req("short", t=2, first=5.0))
    plan = s.schedule()
    assert plan.preempted == ("b",)


def test_no_preemption_when_the_waiting_request_is_not_shorter_or_c_is_zero():
    for c, waiting_pred in ((0.8, 60.0), (0.0, 1.0)):
        s = _sched(seqs=2, c=c)
        a, b = _req("a", first=50.0), _req("b", t=1, first=30.0)
        for r in (a, b):
            s.add(r)
        apply_plan(s, s.schedule())
        s.add(_req("w", t=2, first=waiting_pred))
        plan = s.schedule()
        assert plan.preempted == () and not plan.prefills
        assert set(s.running) == {a, b}


def test_kv_full_also_counts_as_a_full_batch():
    s = _sched(seqs=8, blocks=4, page_size=4)  # 16 token slots
    a = _req("a", prompt_len=12, first=50.0)
    s.add(a)
    apply_plan(s, s.schedule())
    s.add(_req("short", prompt_len=8, t=1, first=3.0))
    plan = s.schedule()
    assert plan.preempted == ("a",)
    assert [c.request_id for c in plan.prefills] == ["short"]


# -- an engine run ---------------------------------------------------------------------------
@pytest.mark.slow
def test_engine_sprpt_run_frees_every_block_and_matches_greedy_reference(tmp_path):
    ref_llm = small_llm()
    h = ref_llm.engine.model_config.hidden_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 300, int(n)).tolist() for n in rng.integers(4, 40, 10)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in ref_llm.generate(prompts, params)]
    # A probe on random data: its predictions differ between requests, which is all the
    # scheduling needs here; max_tokens fixes the actual lengths.
    probe, _ = train_probe(rng.normal(size=(256, h)), rng.integers(0, 16, 256),
                           LengthBins.equal(num_bins=4, max_len=16), layer=1, hidden=32,
                           steps=50, learning_rate=1e-2)
    path = tmp_path / "probe.npz"
    probe.save(path)
    llm = small_llm(scheduler="sprpt", length_probe=str(path), sprpt_c=1.0)
    assert isinstance(llm.engine.scheduler, SPRPTScheduler)
    out = run_checked(llm, prompts, params)
    assert out == ref
    assert llm.engine.allocator.num_allocated == 0
    assert llm.engine.scheduler.num_policy_preemptions > 0


def test_sprpt_without_a_probe_is_refused():
    with pytest.raises(ValueError, match="length probe"):
        small_llm(scheduler="sprpt")


@pytest.mark.slow
def test_tiny_tasks_sprpt_works_out_of_the_box_with_the_shipped_probe():
    from jserve.train.length_task import format_prompt, sample_tasks

    tasks = [t for t in sample_tasks(12, 123) if len(t.answer) < 400][:4]
    llm = small_llm("tiny-tasks", scheduler="sprpt", max_num_seqs=2)
    eng = llm.engine
    assert eng.length_tracker.probe is not None and eng.length_tracker.layer == 3
    params = SamplingParams(temperature=0.0, max_tokens=450)
    ids = [eng.add_request(format_prompt(t.prompt), params) for t in tasks]
    reqs = {i: eng.requests[i] for i in ids}
    done, seen = {}, []
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
            # a prediction made in a step counts the token that step generated as to come
            seen.append((o.request_id, reqs[o.request_id].predicted_remaining,
                         len(o.token_ids) - 1))
        eng.allocator.check()
    assert eng.allocator.num_allocated == 0
    for i in ids:
        assert done[i].finish_reason == "stop"  # the model ends its answers with EOS
        assert reqs[i].first_prediction is not None
    errors = [abs(pred - (len(done[i].token_ids) - k)) for i, pred, k in seen]
    # The refined predictions track the remaining length (answers span 1-400 tokens; the
    # evaluation measured a 12.7-token mean absolute error).
    assert len(errors) > 100 and np.mean(errors) < 40, np.mean(errors)

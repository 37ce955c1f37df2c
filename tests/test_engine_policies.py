"""The live engine under each scheduling policy: identical greedy outputs, conserved blocks,
adaptive chunks from the time budget, and the policy's ordering decisions on real requests."""
from __future__ import annotations

import time

import numpy as np
import pytest

from jserve import SamplingParams
from jserve.engine.loop.timing import estimated_predictor
from jserve.scheduler.plan import BatchPlan
from jserve.scheduler.predictor import CorrectedPredictor, LinearPredictor
from llm_helpers import run_checked, small_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
rng = np.random.default_rng(11)
PROMPTS = [rng.integers(0, 256, n).tolist() for n in (5, 90, 300, 17)]


@pytest.fixture(scope="module")
def reference():
    llm = small_llm()
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fcfs", "edf", "lrs", "lars"])
def test_every_policy_gives_the_reference_greedy_outputs(policy, reference, tmp_path):
    # 1 ms a token plus 1 us per (query, key) pair, a 70 ms budget and a 128-token cap.
    path = tmp_path / "p.json"
    predictor = LinearPredictor((0.0, 1e-3, 0.0, 0.0, 1e-6, 0.0))
    predictor.save(path)
    # A prefill alone may take the whole 128 tokens (full_chunk_alone): off, to see the budget.
    llm = small_llm(scheduler=policy, iteration_budget=0.07, max_num_batched_tokens=128,
                    predictor_path=str(path), predictor_correction=False,
                    full_chunk_alone=False)
    assert llm.engine.predictor == predictor
    assert run_checked(llm, PROMPTS, GREEDY) == reference
    plans = [plan for plan, _ in llm.engine.step_log]
    assert all(p.num_tokens <= 128 and len(p.prefills) <= llm.engine.config.max_prefill_seqs
               for p in plans)
    longest = max(c.num_tokens for plan in plans for c in plan.prefills)
    if policy == "fcfs":  # ignores the time budget: as many tokens as the step has room for
        assert longest > 70
    else:  # the time budget, not the token cap, sets the chunks; short prompts finished
        # whole where nothing fits beside the plan (DeadlineScheduler._whole) aside
        sched = llm.engine.scheduler
        short = lambda c: c.samples and sched.cache.lookup(c.start + c.num_tokens) <= sched.pack_s  # noqa: E731
        assert all(predictor.predict(BatchPlan(plan.decodes, tuple(
            c for c in plan.prefills if not short(c)))) <= 0.07 + 1e-9 for plan in plans)
        assert longest <= 64


def _first_token_order(policy: str) -> list[str]:
    """A 400-token prompt starts; a 6-token prompt with a tight TTFT SLO arrives after two
    steps (with the same arrival stamp, so wall-clock noise cannot change deadlines)."""
    # The predictor's online correction off: it follows measured step times, which would let
    # machine load change the keys this case is built on.
    eng = small_llm(scheduler=policy, predictor_correction=False).engine
    t0 = time.monotonic()
    eng.add_request(PROMPTS[2] + PROMPTS[1][:100], GREEDY, request_id="long", arrival_time=t0)
    eng.step()
    eng.step()
    eng.add_request(PROMPTS[0] + [1], GREEDY, request_id="short", arrival_time=t0, ttft_slo=0.05)
    order = []
    while eng.has_unfinished():
        for out in eng.step():
            if len(out.token_ids) == 1:
                order.append(out.request_id)
    return order


@pytest.mark.parametrize("policy,order", [("fcfs", ["long", "short"]),
                                          ("sarathi", ["long", "short"]),
                                          ("edf", ["short", "long"]),
                                          ("lars", ["short", "long"])])
def test_a_short_request_overtakes_a_long_prefill_only_under_deadline_policies(policy, order):
    assert _first_token_order(policy) == order


def test_predictor_loading_and_bad_names(tmp_path):
    with pytest.raises(ValueError, match="scheduler must be one of"):
        small_llm(scheduler="sjf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        small_llm(scheduler="lars", predictor_path=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="iteration_budget must be > 0"):
        small_llm(scheduler="lars", iteration_budget=0)
    with pytest.warns(DeprecationWarning, match="tpot_slo"), \
            pytest.raises(ValueError, match="iteration_budget must be > 0"):
        small_llm(scheduler="lars", tpot_slo=0)  # the old name still reaches the budget
    eng = small_llm(scheduler="lars", compilation_cache_dir=str(tmp_path / "xla")).engine
    # Nothing profiled: the estimate, corrected online from step times.
    assert eng.predictor.base == estimated_predictor(eng.model_config)
    with pytest.raises(ValueError, match="ttft_slo must be > 0"):
        eng.add_request([1, 2, 3], GREEDY, ttft_slo=-1.0)
    assert not eng.has_unfinished()


def test_the_engine_feeds_every_step_time_to_the_corrected_predictor():
    eng = small_llm(scheduler="lars").engine
    pred = eng.scheduler.predictor
    assert isinstance(pred, CorrectedPredictor) and pred is eng.predictor
    eng.step_log = []
    for n in (40, 3, 90):
        eng.add_request(list(range(1, n + 1)), SamplingParams(temperature=0.0, max_tokens=6,
                                                              ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    scale = 1.0
    for plan, seconds in eng.step_log:  # the same exponential average, step by step
        if plan.burst > 1:
            continue  # a decode burst's time covers several steps: not fed
        ratio = seconds / pred.base.predict(plan)
        scale = min(pred.hi, max(pred.lo, (1 - pred.alpha) * scale + pred.alpha * ratio))
    # Eight single steps, all fed, then one burst of 2 (the last two decode steps), not.
    assert [plan.burst for plan, _ in eng.step_log] == [1] * 8 + [2]
    assert pred.scale == pytest.approx(scale, rel=1e-12)
    assert pred.scale != 1.0
    off = small_llm(scheduler="lars", predictor_correction=False).engine
    assert not isinstance(off.scheduler.predictor, CorrectedPredictor)

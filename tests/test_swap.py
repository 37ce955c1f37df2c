"""Swap-to-host preemption: KV pages copied out under pressure and back on readmission give
token-identical greedy outputs, conserve blocks and host copies, and the auto mode picks the
cheaper of swap and recompute."""
from __future__ import annotations

import numpy as np
import pytest

from jserve import SamplingParams
from jserve.scheduler.predictor import LinearPredictor
from llm_helpers import run_checked, small_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
rng = np.random.default_rng(7)
PROMPTS = [rng.integers(0, 256, n).tolist() for n in (3, 40, 100, 60)]
# 10 usable blocks of 16 tokens (default model: 4 layers x 2 KV heads x 64 x f32, K and V).
TINY_POOL = dict(kv_cache_bytes=11 * 2 * 4 * 2 * 16 * 64 * 4, max_model_len=160)


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in small_llm().generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("policy", ["sarathi", "lars"])
def test_swapped_requests_resume_with_identical_greedy_outputs(policy, reference):
    llm = small_llm(scheduler=policy, preemption="swap", **TINY_POOL)
    assert run_checked(llm, PROMPTS, GREEDY) == reference
    sched = llm.engine.scheduler
    assert sched.num_swaps > 0 and sched.num_swaps == sched.num_preemptions
    assert llm.engine.allocator.num_allocated == 0
    assert not llm.engine.host_kv.copies and not llm.engine.scheduler.swap_policy.reserved


def test_penalised_requests_recompute_instead_of_swapping():
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            repetition_penalty=1.3, frequency_penalty=0.4)
    expected = [o.token_ids for o in small_llm().generate(PROMPTS, params)]
    llm = small_llm(preemption="swap", **TINY_POOL)
    assert run_checked(llm, PROMPTS, params) == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.num_swaps == 0


def test_aborting_a_swapped_request_drops_its_host_copy(reference):
    eng = small_llm(preemption="swap", **TINY_POOL).engine
    ids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    while not eng.host_kv.copies:
        eng.step()
    victim = next(iter(eng.host_kv.copies))
    assert eng.abort(victim).finish_reason == "abort"
    assert victim not in eng.host_kv.copies and victim not in eng.scheduler.swap_policy.reserved
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    for rid, ref in zip(ids, reference):
        if rid != victim:
            assert outs[rid] == ref
    assert eng.allocator.num_allocated == 0 and not eng.host_kv.copies
    assert not eng.scheduler.swap_policy.reserved


def _mode(tmp_path, per_token_s, **kw):
    path = tmp_path / f"p{per_token_s}.json"
    LinearPredictor((0.0, per_token_s, 0.0, 0.0, 0.0, 0.0)).save(path)
    eng = small_llm(scheduler="lars", predictor_path=str(path), **kw).engine
    eng.add_request(PROMPTS[2], GREEDY)
    req = next(iter(eng.requests.values()))
    req.num_computed = 100
    policy = eng.scheduler.swap_policy
    swaps = policy.swaps(req, eng.allocator.pages_for(req.num_computed))
    return ("swap" if swaps else "recompute"), eng


def test_auto_mode_swaps_only_when_the_copy_is_cheaper(tmp_path):
    # 100 tokens: 7 pages of 64 KiB, about 2 ms there and back on CPU.
    assert _mode(tmp_path, 1e-3)[0] == "swap"          # recompute 100 ms
    assert _mode(tmp_path, 1e-6)[0] == "recompute"     # recompute 0.1 ms
    mode, eng = _mode(tmp_path, 1e-3, swap_space_bytes=6 * 65536)
    assert mode == "recompute" and not eng.scheduler.swap_policy.reserved  # 7 pages do not fit
    assert _mode(tmp_path, 1e-6, preemption="swap")[0] == "swap"

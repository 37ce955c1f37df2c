"""Runtime predictor fitting, adaptive chunk sizing and the prefill-time cache."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jserve.scheduler.chunking import PrefillTimeCache, largest_chunk
from jserve.scheduler.plan import BatchPlan, ScheduledChunk, with_chunk
from jserve.scheduler.predictor import (
    FEATURES,
    CorrectedPredictor,
    LinearPredictor,
    plan_features,
)

# constant, per token, per decode, per decode-context token, per chunk x context, per prefill
TRUE = LinearPredictor((2e-3, 2e-5, 1e-5, 1e-8, 4e-9, 1e-4))


def _random_plan(rng) -> BatchPlan:
    decodes = tuple(ScheduledChunk(f"d{i}", int(rng.integers(1, 8000)), 1, True)
                    for i in range(int(rng.integers(0, 64))))
    prefills = tuple(ScheduledChunk(f"p{i}", int(rng.integers(0, 60000)),
                                    int(rng.integers(1, 2048)), False)
                     for i in range(int(rng.integers(0 if decodes else 1, 4))))
    return BatchPlan(decodes, prefills)


def test_fit_recovers_a_linear_model_and_reports_held_out_error(tmp_path):
    rng = np.random.default_rng(0)
    plans = [_random_plan(rng) for _ in range(200)]
    noisy = [(p, TRUE.predict(p) * (1 + rng.normal(0, 0.02))) for p in plans]
    fitted = LinearPredictor.fit(noisy[:150], meta={"model": "toy"})
    held_out = fitted.relative_errors(noisy[150:])
    assert np.median(held_out) < 0.03
    exact = LinearPredictor.fit([(p, TRUE.predict(p)) for p in plans])
    np.testing.assert_allclose(exact.coef, TRUE.coef, rtol=1e-6)
    fitted.save(tmp_path / "p.json")
    assert LinearPredictor.load(tmp_path / "p.json") == fitted
    assert LinearPredictor.load(tmp_path / "p.json").meta == {"model": "toy"}


def test_features_and_empty_plan():
    plan = BatchPlan((ScheduledChunk("a", 9, 1, True),), (ScheduledChunk("b", 100, 28, False),))
    assert dict(zip(FEATURES, plan_features(plan))) == {
        "constant": 1, "tokens": 29, "decodes": 1, "decode_context": 10,
        "prefill_attention": 28 * 128, "prefill_seqs": 1}
    assert TRUE.predict(BatchPlan((), ())) == 0.0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget_ms=st.floats(5, 200),
       start=st.integers(0, 200_000), remaining=st.integers(1, 100_000))
def test_packed_chunk_is_the_largest_that_fits_the_budget(seed, budget_ms, start, remaining):
    rng = np.random.default_rng(seed)
    base = BatchPlan(tuple(ScheduledChunk(f"d{i}", int(rng.integers(1, 4000)), 1, True)
                           for i in range(int(rng.integers(0, 32)))), ())
    budget = budget_ms / 1e3
    n = largest_chunk(TRUE, base, "r", start, remaining, budget, max_chunk=8192)
    assert 0 <= n <= min(remaining, 8192)
    if n:
        assert n % 32 == 0 or n == remaining
        assert TRUE.predict(with_chunk(base, "r", start, n, False)) <= budget
    bigger = min(n + 32, remaining, 8192) if n % 32 == 0 else n
    if bigger > n:
        assert TRUE.predict(with_chunk(base, "r", start, bigger, False)) > budget


def test_chunks_shrink_as_the_prefill_kv_grows():
    sizes = [largest_chunk(TRUE, BatchPlan((), ()), "r", kv, 10**7, 0.05) for kv in
             (0, 16_000, 64_000, 256_000, 1_000_000)]
    assert sizes[:4] == sorted(sizes[:4], reverse=True) and len(set(sizes[:4])) == 4
    assert sizes[3] > 0 and sizes[4] == 0  # at 1M context not even 32 tokens fit 50 ms here


def test_prefill_time_cache_sums_the_adaptive_chunk_sequence():
    cache = PrefillTimeCache(TRUE, 100_000, 0.05)
    done, total, marks = 0, 0.0, {}
    while done < 100_000:  # replay the adaptive sequence by hand
        n = largest_chunk(TRUE, BatchPlan((), ()), "_", done, 100_000 - done, 0.05)
        total += TRUE.predict(with_chunk(BatchPlan((), ()), "_", done, n, False))
        done += n
        marks[done] = total
    assert cache.time(100_000) == pytest.approx(total, rel=1e-9)
    for length, t in marks.items():  # chunk ends sit between 256-token table points
        assert cache.time(length) == pytest.approx(t, rel=0.01)
    times = [cache.time(n) for n in range(0, 100_001, 256)]
    assert times == sorted(times) and times[0] == 0.0
    assert cache.remaining(100_000, 40_000) == pytest.approx(
        cache.time(100_000) - cache.time(40_000))
    # Isolated prefill is superlinear in length (attention grows with context).
    assert cache.time(100_000) > 2.5 * cache.time(40_000)


def test_the_corrected_predictor_follows_measured_step_times():
    plan = BatchPlan((ScheduledChunk("a", 900, 1, True),), (ScheduledChunk("b", 0, 256, False),))
    fixed = CorrectedPredictor(TRUE, alpha=0.5)
    assert fixed.predict(plan) == TRUE.predict(plan)
    for _ in range(30):  # steps take twice the prediction on this machine
        fixed.observe(plan, 2 * TRUE.predict(plan))
    assert fixed.scale == pytest.approx(2.0, rel=1e-6)
    assert fixed.predict(plan) == pytest.approx(2 * TRUE.predict(plan), rel=1e-6)
    # The chunk search packs to the budget under the corrected times: the chunk it finds
    # for a 50 ms budget is what the uncorrected model finds for 25 ms.
    base = BatchPlan((), ())
    assert largest_chunk(fixed, base, "r", 4096, 10**6, 0.05) == \
        largest_chunk(TRUE, base, "r", 4096, 10**6, 0.025)
    fixed.observe(plan, 1e3)  # an outlier moves it at most to the clamp
    assert fixed.scale == fixed.hi
    fixed.observe(plan, 0.0)  # nothing measured: ignored
    assert fixed.scale == fixed.hi


"""``BuiltStep.resized``: a built step re-padded to a larger bucket shape (what a pipeline tick
does to the batches in flight, ``jserve.engine.batch.tick_slots``) is exactly the step built at that
shape, and runs to the same tokens as the step at its own shape."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve import SamplingParams
from jserve.engine.requests.state import NEUTRAL_ROW
from llm_helpers import small_llm

# Greedy, seeded sampling and logprobs (no penalties: running a step twice would count its
# tokens twice in the penalty state).
PARAMS = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=6, temperature=0.9, top_k=40, seed=11, ignore_eos=True,
                         logprobs=2)]
LENGTHS = (1, 5, 9, 4, 70, 3, 12, 20)


def _covers(big, small) -> bool:
    return big != small and big[0] >= small[0] and big[1] >= small[1]


def _assert_same_step(got, want):
    assert got.shape == want.shape
    assert jax.tree.structure(got.arrays) == jax.tree.structure(want.arrays)
    for a, b in zip(jax.tree.leaves(got.arrays), jax.tree.leaves(want.arrays), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert [(r, c) for r, c in got.sample_rows] == [(r, c) for r, c in want.sample_rows]


@pytest.fixture(scope="module")
def recorded():
    """Every step a mixed workload builds, each also built directly at every larger bucket
    shape (from the same request state), and one mixed step's samples at its own shape and
    at the largest one."""
    eng = small_llm(max_num_seqs=8).engine
    # The engine's mixed steps take all 8 decode rows (buckets.py); a pipeline tick resizes
    # between any bucket shapes, so a grid with 4 too gives steps that grow both ways.
    fine = dataclasses.replace(eng.buckets, decode_rows=(0, 4, 8))
    eng.buckets = eng.builder.buckets = eng.runner.programs.lowering.buckets = fine
    build, runner = eng.builder.build, eng.runner
    steps, samples = [], {}

    def keep(*args, **kwargs):
        built = build(*args, **kwargs)
        if "shape" in kwargs:  # builder.empty
            return built
        larger = {k: build(*args, shape=k, **kwargs)
                  for k in eng.buckets.all_shapes() if _covers(k, built.shape)}
        steps.append((built, larger))
        bd, tp = built.shape
        both = [k for k in larger if k[0] > bd and k[1] > tp]
        if bd and tp and both and not samples and len(built.sample_rows) > 1:
            big = max(both, key=sum)
            resized = built.resized(eng.builder.empty(big, NEUTRAL_ROW))
            # Each run samples into last_tokens, which feeds this step's decode tokens
            # (async scheduling): every run, the engine's own included, starts from the same.
            last = np.asarray(runner.state.last_tokens)
            for key, step in (("own", built), ("big", resized)):
                samples[key] = step, runner.execute(step.shape, step.arrays)
                runner.state = dataclasses.replace(runner.state, last_tokens=jnp.asarray(last))
        return built

    eng.builder.build = keep
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate(LENGTHS)]
    for i, p in enumerate(prompts):
        eng.add_request(p, PARAMS[i % 2])
    while eng.has_unfinished():
        eng.step()
    return eng, steps, samples


def test_resized_equals_the_step_built_at_the_larger_shape(recorded):
    eng, steps, _ = recorded
    kinds = set()
    for built, larger in steps:
        for shape, direct in larger.items():
            _assert_same_step(built.resized(eng.builder.empty(shape, NEUTRAL_ROW)), direct)
            kinds.add((built.shape[0] > 0, built.shape[1] > 0,
                       shape[0] > built.shape[0], shape[1] > built.shape[1]))
    # Decodes beside prefills growing in both dimensions, a prefill-only step taking decode
    # rows, a decode-only step taking prefill tokens.
    assert {(True, True, True, True), (False, True, True, False),
            (True, False, False, True)} <= kinds, kinds


def test_resized_step_samples_the_same_tokens(recorded):
    _, _, samples = recorded
    (own, out_own), (big, out_big) = samples["own"], samples["big"]
    assert own.shape < big.shape and own.arrays.batch.attn.num_prefills > 0
    assert own.arrays.token_fed.any()  # tokens the host has not read, fed on device
    rows_own = [r for r, _ in own.sample_rows]
    rows_big = [r for r, _ in big.sample_rows]
    assert len(rows_own) > 1 and rows_big != rows_own  # the prefill rows moved
    np.testing.assert_array_equal(np.asarray(out_big.tokens)[rows_big],
                                  np.asarray(out_own.tokens)[rows_own])
    np.testing.assert_allclose(np.asarray(out_big.top_logprobs)[rows_big],
                               np.asarray(out_own.top_logprobs)[rows_own], atol=1e-5)


def test_resizing_below_the_built_shape_is_refused(recorded):
    eng, steps, _ = recorded
    built = next(b for b, _ in steps if b.shape[0] > 1)
    with pytest.raises(ValueError, match="cannot resize"):
        built.resized(eng.builder.empty((1, built.shape[1]), NEUTRAL_ROW))
    assert built.resized(eng.builder.empty(built.shape, NEUTRAL_ROW)) is built


def test_a_resized_step_resizes_from_its_original(recorded):
    """A batch in flight meets tick shapes in any order (each covering its own shape)."""
    eng, steps, _ = recorded
    built, larger = next((b, k) for b, k in steps if len(k) > 1)
    big, mid = sorted(larger, key=sum, reverse=True)[:2]
    grown = built.resized(eng.builder.empty(big, NEUTRAL_ROW))
    assert grown.original is built
    _assert_same_step(grown.resized(eng.builder.empty(mid, NEUTRAL_ROW)), larger[mid])
    assert grown.resized(eng.builder.empty(built.shape, NEUTRAL_ROW)) is built


def test_a_tick_covers_every_batch_with_the_smallest_bucket():
    from jserve.engine.batch.buckets import Buckets

    b = Buckets.for_limits(max_num_seqs=8, token_budget=32, max_prefill_seqs=2,
                           max_model_len=512, page_size=16)
    assert b.decode_only_rows == (1, 2, 4, 8) and b.decode_rows == (0, 8)
    assert b.covering([(1, 0), (2, 0)]) == (2, 0)      # decodes only: the fine ladder
    assert b.covering([(2, 0), (0, 16)]) == (8, 16)    # beside a prefill: every decode row
    assert b.covering([(8, 0), (4, 16), (0, 32)]) == (8, 32)
    assert b.covering([(0, 16)]) == (0, 16)

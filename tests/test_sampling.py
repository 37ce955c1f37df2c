"""Tests for SamplingParams validation and the batched device sampler."""
from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from jserve.sampling.params import (
    MAX_BANNED_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from jserve.sampling.sampler import (
    FILTER_PREFIX,
    SampleResult,
    SamplerRow,
    SamplingBatch,
    allowed_mask,
    apply_bias,
    apply_penalties,
    make_sampling_batch,
    row_argmax,
    sample,
    temperature_only,
    temperature_tokens,
    vocab_argmax,
)

sample_jit = jax.jit(sample, static_argnames=("all_greedy", "num_logprobs"))
allowed_mask_jit = jax.jit(allowed_mask)
apply_penalties_jit = jax.jit(apply_penalties)

# ---------------------------------------------------------------------------------------------
# SamplingParams


INVALID = [
    ({"max_tokens": 0}, None, "max_tokens"),
    ({"max_tokens": 2.0}, None, "max_tokens"),
    ({"max_tokens": True}, None, "max_tokens"),
    ({"min_tokens": -1}, None, "min_tokens"),
    ({"min_tokens": 17}, None, "min_tokens"),
    ({"min_tokens": False}, None, "min_tokens"),
    ({"temperature": -1}, None, "temperature"),
    ({"temperature": math.inf}, None, "temperature"),
    ({"temperature": math.nan}, None, "temperature"),
    ({"temperature": "1"}, None, "temperature"),
    ({"top_k": -2}, None, "top_k"),
    ({"top_k": 1.5}, None, "top_k"),
    ({"top_k": True}, None, "top_k"),
    ({"top_k": 101}, 100, "top_k"),
    ({"top_p": 0.0}, None, "top_p"),
    ({"top_p": 1.01}, None, "top_p"),
    ({"top_p": math.nan}, None, "top_p"),
    ({"min_p": -0.1}, None, "min_p"),
    ({"min_p": 1.5}, None, "min_p"),
    ({"repetition_penalty": 0.0}, None, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, None, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, None, "repetition_penalty"),
    ({"presence_penalty": 2.5}, None, "presence_penalty"),
    ({"presence_penalty": -2.01}, None, "presence_penalty"),
    ({"frequency_penalty": 3}, None, "frequency_penalty"),
    ({"frequency_penalty": -2.5}, None, "frequency_penalty"),
    ({"seed": -1}, None, "seed"),
    ({"seed": 2**32}, None, "seed"),
    ({"seed": True}, None, "seed"),
    ({"seed": 1.0}, None, "seed"),
    ({"stop": ""}, None, "stop"),
    ({"stop": ["ok", ""]}, None, "stop"),
    ({"stop": [3]}, None, "stop"),
    ({"stop": 3}, None, "stop"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, None, "stop"),
    ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, None, "stop"),
    ({"stop_token_ids": [-1]}, None, "stop_token_ids"),
    ({"stop_token_ids": [True]}, None, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, None, "stop_token_ids"),
    ({"stop_token_ids": 5}, None, "stop_token_ids"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, None, "stop_token_ids"),
    ({"stop_token_ids": [100]}, 100, "stop_token_ids"),
    ({"ignore_eos": 1}, None, "ignore_eos"),
    ({"detokenize": 0}, None, "detokenize"),
    ({"detokenize": False, "stop": ["x"]}, None, "stop"),
    ({"logprobs": -1}, None, "logprobs"),
    ({"logprobs": MAX_LOGPROBS + 1}, None, "logprobs"),
    ({"logprobs": True}, None, "logprobs"),
    ({"n": 0}, None, "n"),
    ({"n": 17}, None, "n"),
    ({"n": 2, "best_of": 1}, None, "best_of"),
    ({"best_of": 17}, None, "best_of"),
    ({"logit_bias": [5]}, None, "logit_bias"),
    ({"logit_bias": {"five": 1}}, None, "logit_bias"),
    ({"logit_bias": {-1: 1}}, None, "logit_bias"),
    ({"logit_bias": {5: 100.5}}, None, "logit_bias"),
    ({"logit_bias": {5: math.nan}}, None, "logit_bias"),
    ({"logit_bias": {5: True}}, None, "logit_bias"),
    ({"logit_bias": {i: 1 for i in range(MAX_LOGIT_BIAS + 1)}}, None, "logit_bias"),
    ({"logit_bias": {100: 1}}, 100, "logit_bias"),
]


@pytest.mark.parametrize("kwargs,vocab_size,field", INVALID,
                         ids=[f"{f}-{i}" for i, (_, _, f) in enumerate(INVALID)])
def test_invalid_params_name_the_field(kwargs: dict, vocab_size: int | None, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate(vocab_size)


@pytest.mark.parametrize("kwargs,vocab_size,field",
                         [c for c in INVALID if c[1] is not None])
def test_vocab_dependent_rules_only_checked_with_vocab(kwargs: dict, vocab_size: int,
                                                       field: str) -> None:
    SamplingParams(**kwargs)  # fine without a vocabulary
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate(vocab_size)


def test_validate_rechecks_mutated_fields() -> None:
    p = SamplingParams()
    p.temperature = -0.5
    with pytest.raises(ValueError, match="temperature"):
        p.validate()


VALID_EDGES = [
    {"max_tokens": 1, "min_tokens": 1},
    {"temperature": 0.0},
    {"top_k": -1}, {"top_k": 0}, {"top_k": 100},
    {"top_p": 1e-6}, {"top_p": 1.0},
    {"min_p": 0.0}, {"min_p": 1.0},
    {"repetition_penalty": 1e-3},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"seed": 0}, {"seed": 2**32 - 1}, {"seed": np.int64(7)},
    {"stop": ["x"] * MAX_STOP_STRINGS},
    {"stop": ["x" * MAX_STOP_STRING_CHARS]},
    {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))},
    {"stop_token_ids": [99]},
    {"logprobs": 0}, {"logprobs": MAX_LOGPROBS},
]


@pytest.mark.parametrize("kwargs", VALID_EDGES)
def test_valid_edge_values(kwargs: dict) -> None:
    SamplingParams(**kwargs).validate(vocab_size=100)


def test_defaults_and_normalisation() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.logprobs) == (16, 1.0, 0, 1.0, None)
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


# ---------------------------------------------------------------------------------------------
# Helpers


def make_sb(n: int, **per_row) -> SamplingBatch:
    """A batch of ``n`` rows with identical params; ``seeds``/``steps``/``banned`` per row."""
    seeds = per_row.pop("seeds", range(n))
    steps = per_row.pop("steps", [0] * n)
    banned = per_row.pop("banned", [()] * n)
    params = SamplingParams(**per_row)
    rows = [SamplerRow(params, seed=s, step=t, banned_ids=tuple(b))
            for s, t, b in zip(seeds, steps, banned)]
    return make_sampling_batch(rows, n)


def no_history(batch: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((batch, vocab), np.int32), np.zeros((batch, vocab), bool)


def run_sample(logits: np.ndarray, sb: SamplingBatch, *, all_greedy: bool = False,
               num_logprobs: int = 0, counts: np.ndarray | None = None,
               prompt_mask: np.ndarray | None = None) -> SampleResult:
    logits = np.asarray(logits, np.float32)
    zero_counts, no_prompt = no_history(*logits.shape)
    return sample_jit(logits, zero_counts if counts is None else counts,
                      no_prompt if prompt_mask is None else prompt_mask, sb,
                      all_greedy=all_greedy, num_logprobs=num_logprobs)


def mask_set(logits: list[float], **params) -> set[int]:
    sb = make_sb(1, **params)
    mask = allowed_mask_jit(np.asarray([logits], np.float32), sb)
    return set(np.flatnonzero(np.asarray(mask[0])).tolist())


P4 = np.log([0.4, 0.3, 0.2, 0.1]).tolist()


# ---------------------------------------------------------------------------------------------
# allowed_mask on constructed logits


@pytest.mark.parametrize("logits,params,expected", [
    # top-k
    ([1.0, 3.0, 2.0, 0.0], {"top_k": 2}, {1, 2}),
    ([1.0, 3.0, 2.0, 0.0], {"top_k": 1}, {1}),
    ([1.0, 3.0, 2.0, 0.0], {"top_k": 0}, {0, 1, 2, 3}),
    ([1.0, 3.0, 2.0, 0.0], {"top_k": -1}, {0, 1, 2, 3}),
    ([1.0, 3.0, 2.0, 0.0], {"top_k": 4}, {0, 1, 2, 3}),
    ([0.0, 2.0, 2.0, 2.0, 1.0], {"top_k": 2}, {1, 2}),  # ties: lower ids first
    ([2.0, 2.0, 2.0, 2.0], {"top_k": 3}, {0, 1, 2}),
    ([5.0, 1.0, 5.0, 1.0, 5.0], {"top_k": 1}, {0}),
    # top-p: keep while the mass strictly before the token is < top_p
    (P4, {"top_p": 0.35}, {0}),
    (P4, {"top_p": 0.45}, {0, 1}),
    (P4, {"top_p": 0.75}, {0, 1, 2}),
    (P4, {"top_p": 0.95}, {0, 1, 2, 3}),
    (P4, {"top_p": 1.0}, {0, 1, 2, 3}),
    (P4, {"top_p": 1e-6}, {0}),
    ([0.0, -30.0], {"top_p": 1.0}, {0, 1}),  # mass before id 1 rounds to 1.0 in float32
    (P4[::-1], {"top_p": 0.45}, {3, 2}),  # order in the vocabulary does not matter
    ([0.0, 0.0, 0.0, 0.0], {"top_p": 0.3}, {0, 1}),  # ties broken by lower id
    ([0.0, 0.0, 0.0, 0.0], {"top_p": 0.2}, {0}),
    ([0.0, 0.0, 0.0, 0.0], {"top_p": 0.5}, {0, 1}),  # exact boundary: 0.5 before id 2
    # min-p: keep prob >= min_p * max prob
    (P4, {"min_p": 0.6}, {0, 1}),
    (P4, {"min_p": 0.4}, {0, 1, 2}),
    (P4, {"min_p": 0.2}, {0, 1, 2, 3}),
    (P4, {"min_p": 1.0}, {0}),
    (np.log([0.3, 0.3, 0.2, 0.2]).tolist(), {"min_p": 1.0}, {0, 1}),
    # top-p applies to the renormalised top-k survivors: 0.4/0.7 = 0.571 >= 0.5
    (P4, {"top_k": 2, "top_p": 0.5}, {0}),
    (P4, {"top_k": 2, "top_p": 0.6}, {0, 1}),
    (P4, {"top_k": 3, "top_p": 0.9, "min_p": 0.6}, {0, 1}),
    (P4, {"top_k": 3, "top_p": 0.7, "min_p": 0.1}, {0, 1}),
    (P4, {"top_k": 1, "top_p": 1.0, "min_p": 0.0}, {0}),
    # -inf tokens are never allowed, but the argmax always is
    ([0.0, -np.inf, 0.0, -np.inf], {}, {0, 2}),
    ([-np.inf, -np.inf, -np.inf], {}, {0}),
])
def test_allowed_mask_support(logits: list[float], params: dict, expected: set[int]) -> None:
    assert mask_set(logits, **params) == expected


def reference_support(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Straightforward float64 re-statement of the filter rules."""
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    if top_k > 0:
        order = order[:top_k]
    probs = np.exp(logits[order] - logits[order[0]])
    probs /= probs.sum()
    kept, mass = [], 0.0
    for i, p in zip(order, probs):
        if mass < top_p and p >= min_p * probs[0]:
            kept.append(i)
        mass += p
    return set(kept)


@settings(max_examples=40, deadline=None)
@given(logits=st.lists(st.integers(-4, 4).map(lambda x: x / 2), min_size=8, max_size=8),
       top_k=st.integers(0, 8), top_p=st.sampled_from([0.1, 0.33, 0.5, 0.71, 0.9, 1.0]),
       min_p=st.sampled_from([0.0, 0.05, 0.3, 0.8]))
def test_allowed_mask_matches_reference(logits: list[float], top_k: int, top_p: float,
                                        min_p: float) -> None:
    arr = np.asarray(logits, np.float64)
    # Skip cases within rounding distance of a top-p / min-p boundary.
    order = sorted(range(8), key=lambda i: (-arr[i], i))[: top_k or 8]
    probs = np.exp(arr[order] - arr[order[0]])
    probs /= probs.sum()
    assume(np.all(np.abs(np.cumsum(probs)[:-1] - top_p) > 1e-4))
    assume(np.all(np.abs(probs / probs[0] - min_p) > 1e-4))
    assert mask_set(logits, top_k=top_k, top_p=top_p, min_p=min_p) == reference_support(
        arr, top_k, top_p, min_p)


def test_allowed_mask_reads_a_prefix_and_sorts_only_the_rows_it_does_not_decide() -> None:
    """On a vocabulary four prefixes wide, every kind of row gives the whole sort's support:
    those the first FILTER_PREFIX tokens decide (a narrow nucleus, top-k inside them, min-p,
    a tie at the cutoff) and those they do not (a nucleus wider than them, top-k past them)
    beside unfiltered rows; and the program sorts no [rows, vocab] array, only one row at a
    time where it must."""
    vocab = 4 * FILTER_PREFIX
    rng = np.random.default_rng(7)
    peaked = rng.normal(size=vocab) * 6
    flat = rng.normal(size=vocab) * 0.01
    tied = peaked.copy()
    tied[[3, 9]] = tied.max() + 1.0  # the two top tokens tie: top-k 1 keeps the lower id
    cases = [(peaked, dict(top_p=0.9)), (peaked, dict(top_k=40)), (peaked, dict(min_p=0.05)),
             (tied, dict(top_k=1)), (flat, dict(top_p=0.9)),
             (flat, dict(top_k=FILTER_PREFIX + 10, top_p=0.99)), (flat, {}), (peaked, {})]
    logits = np.asarray([c[0] for c in cases], np.float32)
    rows = [SamplerRow(SamplingParams(temperature=1.0, **kw), seed=i, step=0)
            for i, (_, kw) in enumerate(cases)]
    sb = make_sampling_batch(rows, len(rows))
    mask = np.asarray(allowed_mask_jit(logits, sb))
    for row, (arr, kw) in enumerate(cases):
        want = (reference_support(arr.astype(np.float32).astype(np.float64),
                                  kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
                if kw else set(range(vocab)))  # top_p 1 keeps all (the reference's float sum
        # can reach 1 before the row's end)
        assert set(np.flatnonzero(mask[row]).tolist()) == want, (row, kw)
    # The cases reach both paths: row 0's nucleus inside the prefix, row 4's past it.
    assert 1 < mask[0].sum() < FILTER_PREFIX < mask[4].sum()
    assert mask[3].sum() == 1 and mask[3, 3]
    hlo = allowed_mask_jit.lower(logits, sb).compile().as_text()
    sorts = [line for line in hlo.splitlines() if " sort(" in line]
    assert sorts and all(f"[{len(rows)},{vocab}]" not in line for line in sorts), sorts


def test_temperature_only_batches_are_those_temperature_tokens_samples_as_the_chain_does():
    """``temperature_only`` (the step's branch to ``temperature_tokens``): a batch of
    greedy rows and unfiltered sampled rows is one, whatever a greedy row asks; a sampled
    row's filter or draft, or any row's ban or mask, is not. Where it says yes, the tokens
    are the whole chain's, bit for bit."""
    vocab = 64
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)

    def batch(*rows: SamplerRow):
        return make_sampling_batch(list(rows), len(rows) + 1, words=2)  # and a padding row

    def row(params, **kw):
        return SamplerRow(params, seed=3, step=2, **kw)

    filtered = [dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1)]
    yes = [batch(row(greedy), row(hot)),
           batch(row(hot), *(row(dataclasses.replace(greedy, **f)) for f in filtered)),
           batch(row(dataclasses.replace(hot, top_k=vocab)), row(greedy, draft=4))]
    no = [*(batch(row(greedy), row(dataclasses.replace(hot, **f))) for f in filtered),
          batch(row(hot, draft=4)), batch(row(greedy, banned_ids=(2,)), row(hot)),
          batch(row(greedy, allowed=np.zeros(2, np.int32)))]
    assert [bool(temperature_only(sb, vocab)) for sb in yes] == [True] * 3
    assert [bool(temperature_only(sb, vocab)) for sb in no] == [False] * 6
    rng = np.random.default_rng(0)
    for sb in yes:
        n = sb.temperature.shape[0]
        logits = rng.normal(size=(n, vocab)).astype(np.float32)
        chain = sample_jit(logits, np.zeros((n, vocab), np.int32), np.zeros((n, vocab), bool),
                           sb, all_greedy=False, num_logprobs=0).tokens
        assert np.array_equal(jax.jit(temperature_tokens)(logits, sb), chain)


# ---------------------------------------------------------------------------------------------
# Sampling


@pytest.mark.slow
def test_sampling_many_seeds_covers_exactly_the_allowed_support() -> None:
    n = 2000
    probs = np.array([0.2, 0.01, 0.15, 0.12, 0.1, 0.02, 0.25, 0.05, 0.04, 0.03, 0.02, 0.01])
    logits = np.tile(np.log(probs / probs.sum()), (n, 1))
    # top_k=6 -> {6,0,2,3,4,7}; top_p=0.85 on those drops 7 (mass before it: 0.943);
    # min_p=0.35 keeps prob >= 0.0875, which alone would also have dropped 7.
    sb = make_sb(n, top_k=6, top_p=0.85, min_p=0.35, seeds=range(n))
    tokens = np.asarray(run_sample(logits, sb).tokens)
    allowed = [6, 0, 2, 3, 4]
    assert set(tokens.tolist()) == set(allowed)
    # Frequencies follow the renormalised distribution (Gumbel-max is exact sampling).
    expected = probs[allowed] / probs[allowed].sum()
    observed = np.array([(tokens == t).mean() for t in allowed])
    np.testing.assert_allclose(observed, expected, atol=0.04)


@pytest.mark.slow
def test_temperature_scales_before_filtering() -> None:
    n = 300
    logits = np.tile(np.asarray(P4, np.float32), (n, 1))
    # T=1: mass before token 1 is 0.4 < 0.45 -> {0, 1}. T=0.5: 0.533 >= 0.45 -> {0}.
    hot = np.asarray(run_sample(logits, make_sb(n, temperature=1.0, top_p=0.45)).tokens)
    cold = np.asarray(run_sample(logits, make_sb(n, temperature=0.5, top_p=0.45)).tokens)
    assert set(hot.tolist()) == {0, 1}
    assert set(cold.tolist()) == {0}


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_greedy_is_argmax(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(8, 50)).astype(np.float32)
    logits[3, [7, 20]] = logits[3].max() + 1  # tie: the lower id wins
    sb = make_sb(8, temperature=0.0, top_k=3, top_p=0.2, min_p=0.5)
    expected = logits.argmax(-1)
    assert expected[3] == 7
    for all_greedy in (False, True):
        np.testing.assert_array_equal(run_sample(logits, sb, all_greedy=all_greedy).tokens,
                                      expected)


def test_row_argmax_matches_argmax_on_ties_infinities_and_nans() -> None:
    # The CPU form (max, then the lowest index holding it) must pick what jnp.argmax picks.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 300)).astype(np.float32)
    x[1, [5, 200]] = 9.0                   # tie: the lower id
    x[2] = -np.inf                         # nothing allowed: id 0
    x[3, [10, 40]] = np.nan                # NaN wins, the first one
    x[4, :] = 3.0                          # all equal
    x[5, 299] = np.inf                     # +inf at the end
    x[6, [0, 299]] = np.inf
    got = np.asarray(jax.jit(row_argmax)(x))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got[1:], [5, 0, 10, 0, 299, 0])
    # vocabulary-major (the step's logits): the same ids
    np.testing.assert_array_equal(np.asarray(jax.jit(vocab_argmax)(x.T.copy())), got)


@pytest.mark.slow
def test_all_greedy_fast_path_equals_general_path() -> None:
    rng = np.random.default_rng(0)
    batch, vocab = 6, 64
    logits = rng.normal(size=(batch, vocab)).astype(np.float32)
    counts = rng.integers(0, 3, size=(batch, vocab)).astype(np.int32)
    prompt = rng.random((batch, vocab)) < 0.2
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4,
                            frequency_penalty=0.2)
    banned = [tuple(np.argsort(-logits[i])[:2].tolist()) for i in range(batch)]
    rows = [SamplerRow(params, seed=i, step=i, banned_ids=banned[i]) for i in range(batch)]
    sb = make_sampling_batch(rows, batch)
    fast = run_sample(logits, sb, all_greedy=True, num_logprobs=3, counts=counts,
                      prompt_mask=prompt)
    general = run_sample(logits, sb, all_greedy=False, num_logprobs=3, counts=counts,
                         prompt_mask=prompt)
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(general)):
        np.testing.assert_array_equal(a, b)
    penalised = np.array(apply_penalties_jit(logits, counts, prompt, sb))
    for i in range(batch):
        penalised[i, list(banned[i])] = -np.inf
    np.testing.assert_array_equal(fast.tokens, penalised.argmax(-1))


def test_all_greedy_path_skips_sort_and_rng() -> None:
    logits = np.zeros((2, 16), np.float32)
    args = (logits, *no_history(2, 16), make_sb(2, temperature=0.0))
    fast = str(jax.make_jaxpr(functools.partial(sample, all_greedy=True, num_logprobs=0))(*args))
    general = str(jax.make_jaxpr(functools.partial(sample, all_greedy=False, num_logprobs=0))(
        *args))
    primitives = re.compile(r"\b(sort|random_\w+)\[")
    assert {"sort", "random_seed"} <= set(primitives.findall(general))
    assert primitives.findall(fast) == []


def flat_logits(batch: int, vocab: int = 500) -> np.ndarray:
    return np.zeros((batch, vocab), np.float32)


@pytest.mark.slow
def test_seeded_row_is_independent_of_batch_composition() -> None:
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    other = SamplingParams(temperature=1.3, top_k=50)
    row = SamplerRow(target, seed=1234, step=7)
    # Few distinct shapes keep compile time down; pad_to still varies.
    layouts = [
        ([row], 4),
        ([row], 8),
        ([SamplerRow(other, seed=1, step=0), row], 4),
        ([SamplerRow(other, seed=9, step=3)] * 5 + [row], 8),
        ([SamplerRow(SamplingParams(temperature=0), seed=1234, step=8), row,
          SamplerRow(other, seed=1234, step=6)], 8),
    ]
    tokens = []
    for rows, pad_to in layouts:
        sb = make_sampling_batch(rows, pad_to)
        logits = np.random.default_rng(pad_to).normal(size=(pad_to, 500)).astype(np.float32)
        logits[rows.index(row)] = 0.0
        tokens.append(int(run_sample(logits, sb).tokens[rows.index(row)]))
    assert len(set(tokens)) == 1
    # Not trivially constant: other seeds land elsewhere on the flat distribution.
    sb = make_sb(40, temperature=0.9, top_p=0.95, seeds=range(40), steps=[7] * 40)
    assert len(set(np.asarray(run_sample(flat_logits(40), sb).tokens).tolist())) > 30


def test_different_steps_give_different_draws() -> None:
    n = 40
    sb = make_sb(n, seeds=[42] * n, steps=range(n))
    tokens = np.asarray(run_sample(flat_logits(n), sb).tokens)
    assert len(set(tokens.tolist())) > 30
    # ... and the same (seed, step) repeats across calls.
    np.testing.assert_array_equal(run_sample(flat_logits(n), sb).tokens, tokens)


def test_large_seed_values_work() -> None:
    sb = make_sb(4, seeds=[0, 2**31, 2**32 - 2, 2**32 - 1])
    tokens = np.asarray(run_sample(flat_logits(4), sb).tokens)
    assert np.all((tokens >= 0) & (tokens < 500))


# ---------------------------------------------------------------------------------------------
# Penalties and banned ids


def test_penalties_match_hand_computed_values() -> None:
    logits = np.array([[2.0, -2.0, 1.0, -1.0, 0.5, -3.0]], np.float32)
    prompt = np.array([[True, True, False, False, False, False]])
    counts = np.array([[0, 0, 2, 1, 0, 0]], np.int32)
    sb = make_sb(1, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = np.asarray(apply_penalties_jit(logits, counts, prompt, sb))
    # 0: prompt, 2/2 | 1: prompt, -2*2 | 2: output, 1/2 - 0.25*2 - 0.5
    # 3: output, -1*2 - 0.25 - 0.5 | 4, 5: unseen
    np.testing.assert_allclose(out, [[1.0, -4.0, -0.5, -2.75, 0.5, -3.0]], rtol=1e-6)

    sb = make_sb(1, presence_penalty=-1.0, frequency_penalty=-0.5)
    out = np.asarray(apply_penalties_jit(logits, counts, prompt, sb))
    # Negative penalties reward output tokens; the prompt alone triggers nothing here.
    np.testing.assert_allclose(out, [[2.0, -2.0, 3.0, 0.5, 0.5, -3.0]], rtol=1e-6)


def test_default_penalties_are_bit_identical() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 256)).astype(np.float32) * 30
    logits[0, :4] = [-0.0, 0.0, -np.inf, np.float32(1e-30)]
    counts = rng.integers(0, 5, size=logits.shape).astype(np.int32)
    prompt = rng.random(logits.shape) < 0.5
    out = np.asarray(apply_penalties_jit(logits, counts, prompt, make_sb(4)))
    np.testing.assert_array_equal(out.view(np.uint32), logits.view(np.uint32))


@pytest.mark.slow
def test_banned_ids_are_never_sampled() -> None:
    n, vocab = 300, 20
    logits = np.zeros((n, vocab), np.float32)
    logits[:, [3, 11]] = 10.0  # overwhelmingly likely unless banned
    banned = [(3, 11, 0)] * n
    for temperature in (0.0, 1.0):
        sb = make_sb(n, temperature=temperature, banned=banned)
        tokens = np.asarray(run_sample(logits, sb, all_greedy=temperature == 0).tokens)
        assert not np.isin(tokens, [0, 3, 11]).any()
    assert set(tokens.tolist()) == set(range(vocab)) - {0, 3, 11}


def test_logit_bias_moves_the_choice_and_leaves_logprobs_raw() -> None:
    """``logit_bias`` is added to the logits before penalties and sampling: +100 on a token
    makes greedy and sampled rows take it, -100 on the argmax moves greedy to the runner-up,
    and the bias sits before the repetition penalty (which divides a positive logit). The
    logprobs stay the raw model's; rows without a bias are bit-identical to no bias at all."""
    vocab = 16
    logits = np.tile(np.linspace(-1.0, 2.0, vocab, dtype=np.float32), (4, 1))  # argmax 15
    rows = [SamplerRow(SamplingParams(temperature=0.0, logit_bias={3: 100}), 0, 0),
            SamplerRow(SamplingParams(temperature=0.0, logit_bias={"15": -100}), 0, 0),
            SamplerRow(SamplingParams(temperature=1.0, logit_bias={7: 100}), 5, 0),
            SamplerRow(SamplingParams(temperature=0.0), 0, 0)]
    res = run_sample(logits, make_sampling_batch(rows, 4), num_logprobs=2)
    assert np.asarray(res.tokens).tolist() == [3, 14, 7, 15]
    raw = np.asarray(jax.nn.log_softmax(logits[0]))
    np.testing.assert_allclose(np.asarray(res.logprobs), raw[[3, 14, 7, 15]], rtol=1e-6)
    assert np.asarray(res.top_ids)[:, 0].tolist() == [15] * 4  # the raw top, not biased
    # The bias comes first: token 0 (-1.0, in the prompt, repetition penalty 2) biased by
    # +2.5 is (-1.0 + 2.5) / 2 = 0.75 > token 1's 0.6; penalised first it would be
    # -1.0 * 2 + 2.5 = 0.5 < 0.6.
    one = np.full((1, vocab), -5.0, np.float32)
    one[0, :2] = -1.0, 0.6
    counts, prompt = no_history(1, vocab)
    prompt[0, 0] = True
    row = SamplerRow(SamplingParams(temperature=0.0, repetition_penalty=2.0,
                                    logit_bias={0: 2.5}), 0, 0)
    got = run_sample(one, make_sampling_batch([row], 1), counts=counts, prompt_mask=prompt)
    assert int(np.asarray(got.tokens)[0]) == 0
    # Rows without a bias (their ids all -1 padding): the logits bit for bit.
    plain = make_sampling_batch(rows[3:], 1)
    assert plain.bias_ids.shape == (1, MAX_LOGIT_BIAS)
    out = np.asarray(jax.jit(apply_bias)(logits[:1], plain))
    np.testing.assert_array_equal(out.view(np.uint32), logits[:1].view(np.uint32))


def test_the_allowed_bitmask_is_obeyed_and_all_ones_rows_change_nothing() -> None:
    """Structured output's mask: bit t of a row allows token t; words past the mask's width
    allow everything, so all-ones (-1) rows sample exactly as without a mask."""
    n, vocab = 200, 40
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(n, vocab)).astype(np.float32)
    allowed_ids = [1, 5, 33, 38]
    row = np.zeros(2, np.int32)
    for t in allowed_ids:
        row[t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-2**31)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature)
        masked = make_sampling_batch([SamplerRow(params, seed=i, step=0, allowed=row)
                                      for i in range(n)], n, words=2)
        free = make_sampling_batch([SamplerRow(params, seed=i, step=0) for i in range(n)], n,
                                   words=2)
        tokens = np.asarray(run_sample(logits, masked, all_greedy=temperature == 0).tokens)
        assert set(tokens.tolist()) <= set(allowed_ids)
        if temperature:
            assert set(tokens.tolist()) == set(allowed_ids)  # every allowed one is drawn
        else:  # greedy: the best allowed token
            np.testing.assert_array_equal(tokens, np.asarray(allowed_ids)[
                np.argmax(logits[:, allowed_ids], axis=1)])
        unmasked = run_sample(logits, free, all_greedy=temperature == 0).tokens
        narrow = make_sampling_batch([SamplerRow(params, seed=i, step=0) for i in range(n)],
                                     n)  # one word: the rest allowed
        np.testing.assert_array_equal(unmasked, run_sample(logits, narrow,
                                                           all_greedy=temperature == 0).tokens)


def test_banned_padding_does_not_ban_last_token() -> None:
    logits = np.zeros((2, 10), np.float32)
    logits[:, 9] = 5.0
    sb = make_sb(2, temperature=0.0, banned=[(), (9,)])
    np.testing.assert_array_equal(run_sample(logits, sb).tokens, [9, 0])


# ---------------------------------------------------------------------------------------------
# Logprobs


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), num_logprobs=st.sampled_from([0, 1, 5]))
def test_logprobs_are_raw_log_softmax(seed: int, num_logprobs: int) -> None:
    rng = np.random.default_rng(seed)
    batch, vocab = 5, 40
    logits = (rng.normal(size=(batch, vocab)) * 3).astype(np.float32)
    counts = rng.integers(0, 2, size=(batch, vocab)).astype(np.int32)
    sb = make_sb(batch, temperature=0.7, top_k=10, repetition_penalty=1.5,
                 frequency_penalty=1.0, seeds=range(seed, seed + batch))
    res = run_sample(logits, sb, num_logprobs=num_logprobs, counts=counts)
    expected = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    tokens = np.asarray(res.tokens)
    np.testing.assert_allclose(res.logprobs, expected[np.arange(batch), tokens], rtol=1e-5,
                               atol=1e-6)
    assert res.top_ids.shape == res.top_logprobs.shape == (batch, num_logprobs)
    assert res.top_ids.dtype == jnp.int32
    top = np.asarray(res.top_logprobs)
    assert np.all(np.diff(top, axis=-1) <= 0)
    np.testing.assert_allclose(top, -np.sort(-expected, axis=-1)[:, :num_logprobs], rtol=1e-6)
    np.testing.assert_array_equal(
        np.take_along_axis(expected, np.asarray(res.top_ids), axis=-1), top)


# ---------------------------------------------------------------------------------------------
# make_sampling_batch


def test_make_sampling_batch_layout_and_padding() -> None:
    rows = [SamplerRow(SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1,
                                      repetition_penalty=1.2, presence_penalty=0.3,
                                      frequency_penalty=-0.4), seed=2**32 - 1, step=5,
                       banned_ids=(7, 8)),
            SamplerRow(SamplingParams(top_k=4), seed=3, step=0)]
    sb = make_sampling_batch(rows, 4)
    np.testing.assert_allclose(sb.temperature, [0.5, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(sb.top_k, [0, 4, 0, 0])
    np.testing.assert_allclose(sb.top_p, [0.9, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(sb.min_p, [0.1, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(sb.repetition_penalty, [1.2, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(sb.presence_penalty, [0.3, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(sb.frequency_penalty, [-0.4, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(sb.seed, [2**32 - 1, 3, 0, 0])
    np.testing.assert_array_equal(sb.step, [5, 0, 0, 0])
    assert sb.banned_ids.shape == (4, MAX_BANNED_IDS)
    assert sb.banned_ids[0, :3].tolist() == [7, 8, -1] and np.all(sb.banned_ids[1:] == -1)
    expected_dtypes = ([np.float32, np.int32] + [np.float32] * 5
                       + [np.uint32, np.int32, np.int32, np.int32, np.int32, np.int32,
                          np.float32])
    assert [leaf.dtype for leaf in jax.tree.leaves(sb)] == expected_dtypes
    assert np.all(sb.draft == -1)  # no speculative draft to verify
    assert sb.allowed.shape == (4, 1) and np.all(sb.allowed == -1)  # no constraint: all ones


def test_make_sampling_batch_rejects_bad_sizes() -> None:
    row = SamplerRow(SamplingParams(), seed=0, step=0)
    with pytest.raises(ValueError, match="pad_to"):
        make_sampling_batch([row, row], 1)
    with pytest.raises(ValueError, match="banned_ids"):
        make_sampling_batch([SamplerRow(SamplingParams(), 0, 0,
                                        tuple(range(MAX_BANNED_IDS + 1)))], 1)
    assert make_sampling_batch([], 0).banned_ids.shape == (0, MAX_BANNED_IDS)

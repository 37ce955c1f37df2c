"""Rejection sampling of draft tokens preserves the target distribution: on an 8-token
vocabulary, 20 000 rows each verifying a draft return tokens whose empirical distribution
matches the processed target (temperature 1, then top-p, or a frequency/presence penalty)
under a chi-square test at significance 0.001, whether the draft is likely, unlikely or
outside the top-p set (then never returned)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from jserve.sampling.params import SamplingParams
from jserve.sampling.sampler import SamplerRow, make_sampling_batch, sample

ROWS = 20_000
LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0], np.float32)
COUNTS = np.array([3, 0, 1, 0, 0, 2, 0, 0], np.int32)  # tokens already generated


def _target(params: SamplingParams) -> np.ndarray:
    """The distribution the sampler draws from, computed independently in numpy."""
    x = LOGITS.astype(np.float64) - params.frequency_penalty * COUNTS \
        - params.presence_penalty * (COUNTS > 0)
    x = x / params.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
    keep = np.zeros_like(p, bool)
    keep[order] = before < params.top_p
    p = np.where(keep, p, 0.0)
    return p / p.sum()


@functools.partial(jax.jit, static_argnames="rows")
def _run(sb, counts, rows):
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (rows, LOGITS.size))
    out = sample(logits, jnp.broadcast_to(counts, (rows, LOGITS.size)),
                 jnp.zeros((rows, LOGITS.size), bool), sb, all_greedy=False, num_logprobs=0)
    return out.tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.3),
], ids=["top_p", "penalty"])
@pytest.mark.parametrize("draft", [0, 3, 7], ids=["likely", "unlikely", "outside"])
def test_rejection_sampling_matches_the_target_distribution(params, draft):
    want = _target(params)
    rows = [SamplerRow(params, seed=i, step=5, draft=draft) for i in range(ROWS)]
    sb = jax.tree.map(jnp.asarray, make_sampling_batch(rows, ROWS))
    tokens = np.asarray(_run(sb, jnp.asarray(COUNTS), ROWS))
    got = np.bincount(tokens, minlength=LOGITS.size)
    assert got[want == 0].sum() == 0  # nothing outside the target's support (top-p cut)
    support = want > 0
    assert chisquare(got[support], ROWS * want[support]).pvalue > 1e-3
    # Accepted as often as the target gives the draft: a draft of probability 0 never is.
    if want[draft] == 0:
        assert got[draft] == 0

"""The sampling tail of a step on a plain greedy batch (``step_program._sample``,
``sampler.plain_greedy``): every row greedy with no ban, mask, bias or penalty takes the
argmax of the logits read in place; any such row sends the batch through the whole chain.
Both ways give exactly the chain's tokens; the plain way carries no vocabulary-sized work
but the argmax's two reductions (no copy, scatter, sort or random draw of the logits)."""
from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.engine.batch.arrays import SampleInputs, SeqState
from jserve.engine.programs import step_program
from jserve.sampling.params import SamplingParams
from jserve.sampling.sampler import (
    ARGMAX_CHUNK,
    SamplerRow,
    make_sampling_batch,
    mask_words,
    plain_greedy,
    row_argmax,
    vocab_argmax,
)

ROWS, VOCAB = 5, 96
GREEDY = SamplingParams(temperature=0.0)


def _inputs(rows: list[SamplerRow], flags: dict) -> tuple[SeqState, SampleInputs]:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(ROWS, VOCAB)).astype(np.float32)
    logits[1, [3, 70]] = 9.0  # a tie: the lower id
    logits[2, 11] = np.nan    # NaN wins where it is
    logits[3, [40, 41]] = 8.0, 7.9  # row 3: 40, then 41
    counts = np.zeros((ROWS + 1, VOCAB), np.int32)
    counts[3, 40] = 1  # row 3 has said 40 once
    state = SeqState(jnp.asarray(counts), jnp.zeros((ROWS + 1, VOCAB), bool),
                     jnp.zeros(ROWS + 1, jnp.int32))
    sb = make_sampling_batch(rows, ROWS, words=mask_words(VOCAB))
    inp = SampleInputs(logits=jnp.asarray(logits.T), state_rows=jnp.arange(ROWS),
                       sampled_state_rows=jnp.arange(ROWS), sampling=jax.tree.map(jnp.asarray, sb),
                       any_random=jnp.asarray(flags.get("any_random", False)),
                       any_penalty=jnp.asarray(flags.get("any_penalty", False)),
                       want_logprobs=jnp.asarray(False),
                       any_bias=jnp.asarray(flags.get("any_bias", False)))
    return state, inp


def _rows(**change) -> list[SamplerRow]:
    rows = [SamplerRow(GREEDY, seed=i, step=i) for i in range(ROWS)]
    rows[3] = rows[3]._replace(**change)
    return rows


MASK = np.zeros(mask_words(VOCAB), np.int32)
MASK[0] = 1 << 7  # only token 7

CASES = [  # (name, rows, flags, plain, row 3's token: None where it is a random draw)
    ("all greedy", _rows(), {}, True, 40),
    ("a banned id", _rows(banned_ids=(40,)), {}, False, 41),
    ("a structured-output mask", _rows(allowed=MASK), {}, False, 7),
    ("a sampling row", _rows(params=SamplingParams(temperature=0.7)), {"any_random": True},
     False, None),
    ("a penalty", _rows(params=SamplingParams(temperature=0.0, repetition_penalty=1.5)),
     {"any_penalty": True}, False, 41),
    ("a logit bias", _rows(params=SamplingParams(temperature=0.0, logit_bias={9: 50.0})),
     {"any_bias": True}, False, 9),
]


@pytest.mark.slow  # compiles the whole sampling chain once
@pytest.mark.parametrize("name,rows,flags,plain,token", CASES, ids=[c[0] for c in CASES])
def test_plain_greedy_decision_and_tokens_equal_the_whole_chain(name, rows, flags, plain,
                                                                token):
    state, inp = _inputs(rows, flags)
    sb = inp.sampling
    assert bool(plain_greedy(sb, inp.any_bias | inp.any_penalty | inp.any_random)) is plain
    got, _ = jax.jit(step_program._sample)(state, inp)
    chain = np.asarray(jax.jit(step_program._choose)(state, inp))
    np.testing.assert_array_equal(np.asarray(got.tokens), chain)
    argmax = np.asarray(jnp.argmax(inp.logits, axis=0))
    np.testing.assert_array_equal(np.delete(chain, 3), np.delete(argmax, 3))
    if token is not None:
        assert chain[3] == token


def _cond_branches(jaxpr) -> list:
    return [e.params["branches"] for e in jaxpr.eqns if e.primitive.name == "cond"]


def test_plain_branch_reads_the_logits_only_by_reductions():
    state, inp = _inputs(_rows(), {})
    jaxpr = jax.make_jaxpr(step_program._sample)(state, inp).jaxpr
    # The first cond picks the tokens: plain greedy, temperature, the chain, and with
    # logprobs (``step_program._sample``).
    plain, temperature, chain, _ = (b.jaxpr for b in _cond_branches(jaxpr)[0])

    def primitives(j) -> set[str]:
        names = set()
        for e in j.eqns:
            names.add(e.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                names |= primitives(sub)
        return names

    heavy = {"scatter", "scatter-add", "scatter_add", "sort", "pad", "copy", "copy_p",
             "random_bits", "random_wrap", "cumsum", "dynamic_update_slice"}
    assert not primitives(plain) & heavy, primitives(plain)
    assert {"reduce_max", "reduce_min"} <= primitives(plain)
    assert primitives(chain) & heavy  # the whole chain does that work, when it must
    assert "random_bits" in primitives(temperature) and "sort" not in primitives(temperature)
    assert dataclasses.fields(SampleInputs)[0].name == "logits"


def test_chunked_row_argmax_equals_argmax_on_ties_and_infinities():
    # A vocabulary ARGMAX_CHUNK divides is read once, chunk by chunk (sampler.row_argmax).
    vocab = 16 * ARGMAX_CHUNK
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, vocab)).astype(np.float32)
    x[1, [ARGMAX_CHUNK - 1, ARGMAX_CHUNK, 5 * ARGMAX_CHUNK]] = 9.0  # a tie across chunks
    x[2] = -np.inf                                                 # nothing allowed: id 0
    x[3, :] = 3.0                                                  # all equal: id 0
    x[4, vocab - 1] = np.inf                                       # +inf in the last chunk
    x[5, [7 * ARGMAX_CHUNK + 3, 7 * ARGMAX_CHUNK + 2]] = 50.0      # a tie inside a chunk
    want = [ARGMAX_CHUNK - 1, 0, 0, vocab - 1, 7 * ARGMAX_CHUNK + 2]
    got = np.asarray(jax.jit(row_argmax)(x))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got[1:], want)
    # The same logits vocabulary-major, as the step's sampling reads them.
    np.testing.assert_array_equal(np.asarray(jax.jit(vocab_argmax)(x.T.copy())), got)

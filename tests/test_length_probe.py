"""The TRAIL length probe: bins, the Bayesian filter's math on constructed vectors, training on
a separable set, and the engine's layer capture (off: the same step; on: the same hidden state
as a direct forward call, prompt embeddings summed across prefill chunks)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.cache.pool import allocate_kv_cache
from jserve.kernels import AttentionMetadata
from jserve.model.decoder import StepInput, forward
from jserve.probe import (
    LengthBins,
    LengthProbe,
    RemainingFilter,
    posterior,
    train_probe,
    transition_matrix,
)
from jserve.sampling.params import SamplingParams
from llm_helpers import small_llm


# -- bins --------------------------------------------------------------------------------
def test_equal_bins_default_has_ten_bins_over_512_plus_overflow():
    b = LengthBins.equal()
    assert b.num_bins == 11
    np.testing.assert_allclose(b.edges, np.arange(11) * 51.2)
    assert b.bin_of([0, 51.1, 51.2, 511.9, 512, 10_000]).tolist() == [0, 0, 1, 9, 10, 10]
    np.testing.assert_allclose(b.widths, [51.2] * 11)
    np.testing.assert_allclose(b.centres[[0, 9, 10]], [25.6, 486.4, 537.6])


def test_log_bins_grow_geometrically_and_keep_an_overflow_bin():
    b = LengthBins.log_spaced(num_bins=4, max_len=8)
    np.testing.assert_allclose(b.edges, [0, 1, 2, 4, 8])
    assert b.num_bins == 5
    assert b.bin_of([0, 1, 3, 7.9, 8, 100]).tolist() == [0, 1, 2, 3, 4, 4]
    np.testing.assert_allclose(b.widths, [1, 1, 2, 4, 4])
    np.testing.assert_allclose(b.centres, [0.5, 1.5, 3, 6, 10])


def test_bad_bins_raise():
    for edges in ((0,), (1, 2), (0, 2, 2), (0, 3, 1)):
        with pytest.raises(ValueError):
            LengthBins(edges)
    with pytest.raises(ValueError):
        LengthBins.equal().bin_of([-1])


# -- the filter --------------------------------------------------------------------------
def test_transition_matrix_by_hand():
    b = LengthBins((0, 2, 6))  # widths 2, 4 and the overflow borrows 4
    t = transition_matrix(b)
    np.testing.assert_allclose(t, [[1, 0, 0],
                                   [0.25, 0.75, 0],
                                   [0, 0.25, 0.75]])
    np.testing.assert_allclose(t.sum(1), 1)


def test_posterior_and_expected_value_by_hand():
    b = LengthBins((0, 2, 6))
    t = transition_matrix(b)
    prev = np.array([0.2, 0.3, 0.5])
    # prior = prev @ T = [0.2 + 0.075, 0.225 + 0.125, 0.375]
    lik = np.array([0.1, 0.6, 0.3])
    want = np.array([0.275 * 0.1, 0.35 * 0.6, 0.375 * 0.3])
    want /= want.sum()
    post = posterior(prev, lik, t)
    np.testing.assert_allclose(post, want)
    # centres 1, 4, 8
    assert b.expected(post) == pytest.approx(want @ [1, 4, 8])

    f = RemainingFilter(b)
    with pytest.raises(ValueError):
        f.update(lik)
    assert f.start(np.array([2.0, 3.0, 5.0])) == pytest.approx(0.2 + 1.2 + 4.0)
    assert f.update(lik) == pytest.approx(want @ [1, 4, 8])


def test_filter_drifts_down_one_bin_per_width_with_a_flat_likelihood():
    b = LengthBins((0, 4, 8))
    f = RemainingFilter(b)
    f.start(np.array([0.0, 0.0, 1.0]))
    flat = np.ones(3)
    for _ in range(4):
        f.update(flat)
    # four tokens at a 1/4 chance of moving down per token: bin 2 keeps 0.75**4
    assert f.probs[2] == pytest.approx(0.75 ** 4)
    assert f.probs.sum() == pytest.approx(1.0)
    assert f.expected < b.centres[2]


# -- training ----------------------------------------------------------------------------
def test_probe_trains_on_a_separable_set_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    bins = LengthBins.equal(num_bins=4, max_len=40)  # 5 bins with the overflow
    centres = rng.normal(size=(5, 16)) * 4
    labels = rng.integers(0, 5, 1000)
    x = centres[labels] + rng.normal(size=(1000, 16))
    remaining = bins.centres[labels]
    probe, losses = train_probe(x, remaining, bins, layer=3, hidden=64, steps=300,
                                batch_size=128, learning_rate=3e-3)
    assert np.mean(losses[-20:]) < 0.2 * np.mean(losses[:5])
    acc = np.mean(probe.probs(x).argmax(1) == labels)
    assert acc > 0.97
    path = tmp_path / "p.npz"
    probe.save(path)
    back = LengthProbe.load(path)
    assert back.layer == 3 and back.bins == bins
    assert back.prior_mean == pytest.approx(remaining.mean())
    np.testing.assert_allclose(back.predict(x[:10]), probe.predict(x[:10]), rtol=1e-6)
    with pytest.raises(ValueError):
        LengthProbe.load(tmp_path / "missing.npz")


# -- capture in the engine ---------------------------------------------------------------
def _device(batch: StepInput) -> StepInput:
    return jax.tree.map(jnp.asarray, batch)


PROMPTS = [list(range(3, 48)), [7, 8, 9, 10], list(range(100, 130))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.slow
def test_capture_off_and_on_give_the_same_tokens():
    off = small_llm()
    assert off.engine.runner.capture_layer is None and off.engine.length_tracker is None
    ref = [o.token_ids for o in off.generate(PROMPTS, PARAMS)]
    assert off.engine.runner.last_capture is None
    on = small_llm(probe_layer=1)
    assert [o.token_ids for o in on.generate(PROMPTS, PARAMS)] == ref


@pytest.mark.slow
def test_capture_matches_a_direct_forward_call_and_prompt_means_span_chunks():
    llm = small_llm(probe_layer=2)
    eng = llm.engine
    eng.length_tracker.log = []
    built_steps = []
    build = eng.builder.build

    def keep(*a, **k):  # records what the engine sends, and sends it unchanged
        built_steps.append(build(*a, **k))
        return built_steps[-1]

    eng.builder.build = keep
    for p in PROMPTS:
        eng.add_request(p, PARAMS)
    eng.step()  # first step: prefill chunks from position 0 into an empty cache
    first = built_steps[0]
    cap = eng.runner.last_capture
    params = eng.runner.params  # already in the runtime layout
    cache = allocate_kv_cache(eng.model_config, eng.allocator.total + 1, eng.config.page_size)
    _, _, want = forward(params, cache, _device(first.arrays.batch), cfg=eng.model_config,
                         capture_layer=2,
                         prompt_mask=first.arrays.token_is_prompt)
    np.testing.assert_allclose(np.asarray(cap.rows), np.asarray(want.rows), atol=1e-4)
    np.testing.assert_allclose(np.asarray(cap.prompt_sum), np.asarray(want.prompt_sum),
                               atol=1e-3)
    while eng.has_unfinished():
        eng.step()
    # The 45-token prompt was prefilled in two chunks (budget 32): its recorded prompt
    # embedding is the mean over both, the same as one whole-prompt forward pass.
    log = {(rid, kind, k): v for rid, k, kind, v in eng.length_tracker.log}
    assert sorted(k for (rid, kind, k) in log if rid == "req-0") == list(range(6))
    p, n = PROMPTS[0], len(PROMPTS[0])
    assert "req-0" not in {c.request_id for _, c in first.sample_rows}  # not done in step 1
    pos = np.arange(n, dtype=np.int32)
    attn = AttentionMetadata(positions=pos, token_seq=np.zeros(n, np.int32),
                             kv_lens=np.asarray([n], np.int32),
                             page_table=np.arange(1, 5, dtype=np.int32)[None],
                             num_prefills=np.asarray(1, np.int32), num_decodes=0)
    batch = StepInput(tokens=np.asarray(p, np.int32), slots=(16 + pos).astype(np.int32),
                      logits_rows=np.asarray([n - 1], np.int32), attn=attn)
    _, _, whole = forward(params, allocate_kv_cache(eng.model_config, 8, 16), _device(batch),
                          cfg=eng.model_config,
                          capture_layer=2)
    np.testing.assert_allclose(log[("req-0", "prompt", 0)], np.asarray(whole.prompt_sum[0]) / n,
                               atol=1e-4)


@pytest.mark.slow
def test_engine_with_a_probe_predicts_from_the_prompt_then_refines(tmp_path):
    rng = np.random.default_rng(1)
    llm = small_llm()
    h = llm.engine.model_config.hidden_size
    bins = LengthBins.equal(num_bins=4, max_len=8)
    probe, _ = train_probe(rng.normal(size=(64, h)), rng.integers(0, 10, 64), bins, layer=1,
                           hidden=32, steps=20)
    path = tmp_path / "probe.npz"
    probe.save(path)
    with pytest.raises(ValueError):
        small_llm(length_probe=str(path), probe_layer=2)
    llm = small_llm(length_probe=str(path))
    eng = llm.engine
    eng.length_tracker.log = []
    rid = eng.add_request(PROMPTS[0], PARAMS)
    req = eng.requests[rid]
    seen = []
    while eng.has_unfinished():
        eng.step()
        if rid in eng.requests:
            seen.append((req.first_prediction, req.predicted_remaining))
    log = [(k, kind, v) for _, k, kind, v in eng.length_tracker.log]
    first = probe.predict(log[0][2][None])[0]
    assert log[0][1] == "prompt" and req.first_prediction == pytest.approx(first)
    f = RemainingFilter(bins)
    f.start(probe.probs(log[0][2][None])[0])
    for _, kind, v in log[1:]:
        assert kind == "token"
        want = f.update(probe.probs(v[None])[0])
    assert req.predicted_remaining == pytest.approx(want)
    assert all(fp == pytest.approx(first) for fp, _ in seen if fp is not None)


@pytest.mark.slow
def test_offline_pairs_match_what_the_engine_captures():
    """The training script's one-pass embeddings are the ones the live tracker sees."""
    from jserve.probe.dataset import sequence_pairs

    llm = small_llm(probe_layer=2)
    eng = llm.engine
    eng.length_tracker.log = []
    outs = llm.generate(PROMPTS[:2], PARAMS)
    log = {(rid, k): v for rid, k, _, v in eng.length_tracker.log}
    for o in outs:
        embs, remaining, k = sequence_pairs(eng.model_config, eng.runner.params, o.prompt_token_ids,
                                            o.token_ids)
        assert embs.shape == (eng.model_config.num_hidden_layers, 6, eng.model_config.hidden_size)
        assert remaining.tolist() == [6, 5, 4, 3, 2, 1] and k.tolist() == list(range(6))
        live = np.stack([log[(o.request_id, i)] for i in range(6)])
        np.testing.assert_allclose(embs[2], live, atol=1e-3)

"""The synthetic length task, the dense training forward, and the shipped "tiny-tasks" model."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve import SamplingParams
from jserve.cache.pool import allocate_kv_cache
from jserve.config import BUILTIN_MODELS
from jserve.kernels import AttentionMetadata
from jserve.model.decoder import StepInput, forward, to_runtime_layout
from jserve.model.weights import init_params, load_config, load_model
from jserve.tokenizer import ByteTokenizer
from jserve.train.length_task import (
    FRUITS,
    KINDS,
    count_down,
    format_prompt,
    is_held_out,
    list_fruits,
    sample_tasks,
)
from jserve.train.trainer import (
    TINY_TASKS_CONFIG,
    TrainConfig,
    batches,
    dense_forward,
    encode_example,
    loss_fn,
    make_optimizer,
    make_train_step,
    pack,
)
from llm_helpers import small_llm


def test_sample_tasks_is_deterministic_per_seed_and_spans_the_length_range():
    a, b, c = sample_tasks(1000, 3), sample_tasks(1000, 3), sample_tasks(1000, 4)
    assert a == b and a != c
    assert {t.kind for t in a} == set(KINDS)
    lens = [len(t.answer) for t in a]
    assert min(lens) < 10 and max(lens) <= 483
    # Every one of the probe's default bins (10 equal bins over 0-512) is used.
    assert set((np.asarray(lens) // 51.2).astype(int).tolist()) == set(range(10))
    with pytest.raises(ValueError, match="n must be"):
        sample_tasks(-1, 0)


def _n(task) -> int:
    return int(re.search(r"\d+", task.prompt).group())


def test_train_and_test_splits_hold_disjoint_counts():
    train, test = sample_tasks(500, 2, "train"), sample_tasks(200, 2, "test")
    assert not any(is_held_out(_n(t)) for t in train)
    assert all(is_held_out(_n(t)) for t in test) and {t.kind for t in test} == set(KINDS)
    assert max(len(t.answer) for t in test) > 460    # held-out lengths reach the last bin too
    with pytest.raises(ValueError, match="split"):
        sample_tasks(1, 0, "dev")


def test_answers_follow_the_rule_the_prompt_states():
    for task in sample_tasks(300, 7):
        n = int(re.fullmatch(r"(?:count down from|list) (\d+)(?: fruits)?", task.prompt).group(1))
        if task.kind == "count_down":
            assert task.answer.split(" ") == [str(i) for i in range(n, 0, -1)]
        else:
            lines = task.answer.split("\n")
            assert len(lines) == n
            assert lines == [f"{n - k}. {FRUITS[k % len(FRUITS)]}" for k in range(n)]
    assert count_down(3).answer == "3 2 1"
    assert list_fruits(2).answer == "2. apple\n1. banana"
    assert len(count_down(148).answer) == 483


def test_encode_and_pack_put_the_loss_on_answer_and_eos_only():
    ex1, ex2 = encode_example(count_down(3)), encode_example(list_fruits(1))
    batch = pack([[ex1, ex2], []], row_len=56)
    ids, n_prompt = ex1
    tok = ByteTokenizer()
    assert ids == tok.encode(format_prompt("count down from 3")) + list(b"3 2 1") + [tok.EOS]
    w = batch.weights[0]
    # Row 0: example 1 then example 2, each weighting the targets answer + EOS.
    targets = batch.targets[0][w > 0]
    assert targets.tolist() == list(b"3 2 1") + [tok.EOS] + list(b"1. apple") + [tok.EOS]
    assert batch.positions[0, len(ids)] == 0 and batch.segments[0, len(ids)] == 2
    assert batch.weights[1].sum() == 0 and (batch.segments[1] == 0).all()
    with pytest.raises(ValueError, match="row_len"):
        pack([[ex1, ex1, ex1]], row_len=56)


def test_batch_stream_is_full_and_deterministic():
    tc = TrainConfig(batch_rows=4, row_len=512, seed=5)
    a, b = batches(tc), batches(tc)
    for _ in range(3):
        x, y = next(a), next(b)
        np.testing.assert_array_equal(x.tokens, y.tokens)
        assert (x.segments > 0).mean() > 0.9   # first-fit-decreasing leaves little padding


def _serving_logits(cfg, params, ids, page=16):
    """All-position logits of one prefill through the serving paged forward."""
    n = len(ids)
    pages = -(-n // page)
    pos = np.arange(n, dtype=np.int32)
    table = np.arange(1, pages + 1, dtype=np.int32)[None]
    attn = AttentionMetadata(positions=jnp.asarray(pos), token_seq=jnp.zeros(n, jnp.int32),
                             kv_lens=jnp.asarray([n], jnp.int32), page_table=jnp.asarray(table),
                             num_prefills=jnp.asarray(1, jnp.int32), num_decodes=0)
    batch = StepInput(tokens=jnp.asarray(ids, jnp.int32), slots=jnp.asarray(page + pos),
                      logits_rows=jnp.asarray(pos), attn=attn)
    logits, _, _ = forward(to_runtime_layout(params), allocate_kv_cache(cfg, pages + 1, page),
                           batch, cfg=cfg)
    return np.asarray(logits)


@pytest.mark.slow
def test_dense_training_forward_matches_the_serving_forward_on_packed_rows():
    cfg = TINY_TASKS_CONFIG
    params = init_params(cfg, seed=3)
    rng = np.random.default_rng(0)
    # Larger weights than init so attention patterns are far from uniform.
    params = jax.tree.map(lambda p: p * 8 if p.ndim == 2 else p, params)
    a, b = rng.integers(0, 256, 37).tolist(), rng.integers(0, 256, 50).tolist()
    batch = pack([[(a, 1), (b, 1)]], row_len=96)
    dense = np.asarray(dense_forward(params, jnp.asarray(batch.tokens),
                                     jnp.asarray(batch.positions), jnp.asarray(batch.segments),
                                     cfg))[0]
    # Each packed example sees only itself: equal to serving it alone.
    np.testing.assert_allclose(dense[:37], _serving_logits(cfg, params, a), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(dense[37:87], _serving_logits(cfg, params, b), atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_training_steps_lower_the_loss_on_a_fixed_batch():
    cfg = TINY_TASKS_CONFIG
    tc = TrainConfig(steps=20, batch_rows=2, row_len=512, lr=3e-3, warmup_steps=1, seed=1)
    batch = jax.tree.map(jnp.asarray, next(batches(tc)))
    params = init_params(cfg, seed=1)
    opt = make_optimizer(tc)
    state = opt.init(params)
    step = make_train_step(cfg, opt)
    first = float(loss_fn(params, batch, cfg))
    for _ in range(8):
        params, state, loss = step(params, state, batch)
    assert float(loss_fn(params, batch, cfg)) < 0.6 * first


def test_tiny_tasks_resolves_to_the_packaged_checkpoint():
    path = BUILTIN_MODELS["tiny-tasks"]
    assert (path / "config.json").exists() and (path / "params").is_dir()
    assert load_config("tiny-tasks") == TINY_TASKS_CONFIG
    cfg, params, tok = load_model("tiny-tasks")
    assert isinstance(tok, ByteTokenizer)
    assert params["layers"][0]["wq"].shape == (128, 128)
    assert load_config("default").hidden_size == 256   # "default" is still the random model


# Prompts the shipped weights answer exactly (pins their behaviour).
PINNED = [count_down(12), count_down(97), list_fruits(9), list_fruits(37),
          count_down(148), list_fruits(38)]


@pytest.mark.slow
def test_tiny_tasks_model_answers_pinned_prompts_exactly_and_stops_with_eos():
    llm = small_llm("tiny-tasks", max_model_len=1024)
    outs = llm.generate([format_prompt(t.prompt) for t in PINNED],
                        SamplingParams(max_tokens=500, temperature=0.0))
    for task, out in zip(PINNED, outs):
        assert out.token_ids[-1] == ByteTokenizer.EOS
        assert llm.tokenizer.decode(out.token_ids) == task.answer

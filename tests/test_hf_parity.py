"""Parity with Hugging Face transformers on random tiny Llama checkpoints of four families
and one 16-layer model."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hf_models import CONFIGS, DEEP_CONFIGS, tiny_llama_dir, tiny_llama_model
from jserve import LLM, SamplingParams
from jserve.cache.pool import allocate_kv_cache
from jserve.kernels import AttentionMetadata
from jserve.model.decoder import StepInput, forward, to_runtime_layout
from jserve.model.weights import load_model

pytestmark = pytest.mark.slow

FAMILIES = sorted(CONFIGS) + sorted(DEEP_CONFIGS)
PROMPTS = [[1, 5, 9, 200, 33, 7, 81, 64, 12, 400, 3 + 30, 77, 5, 9],
           [1, 300, 301, 302],
           list(range(1, 50, 2)) * 2]


@functools.partial(jax.jit, static_argnames=("cfg", "num_pages"))
def _forward_one_sequence(params, batch, *, cfg, num_pages):
    return forward(to_runtime_layout(params), allocate_kv_cache(cfg, num_pages, _PAGE),
                   batch, cfg=cfg)[0]


_PAGE = 4


def _all_position_logits(cfg, params, ids):
    """One prefill of ``ids`` through the paged forward, logits at every position.

    Padded to a multiple of 64 tokens (causal attention leaves earlier rows unchanged), so
    repeated calls reuse one compilation."""
    n = len(ids)
    t = 64 * -(-n // 64)
    pages = t // _PAGE
    table = np.zeros((1, pages), np.int32)
    table[0] = np.arange(1, pages + 1)
    pos = np.arange(t, dtype=np.int32)
    attn = AttentionMetadata(positions=jnp.asarray(pos), token_seq=jnp.zeros(t, jnp.int32),
                             kv_lens=jnp.asarray([t], jnp.int32), page_table=jnp.asarray(table),
                             num_prefills=jnp.asarray(1, jnp.int32), num_decodes=0)
    batch = StepInput(tokens=jnp.asarray(list(ids) + [0] * (t - n), jnp.int32),
                      slots=jnp.asarray(table[0, pos // _PAGE] * _PAGE + pos % _PAGE),
                      logits_rows=jnp.asarray(pos), attn=attn)
    return np.asarray(_forward_one_sequence(params, batch, cfg=cfg, num_pages=pages + 1))[:n]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    cfg, params, _ = load_model(str(tiny_llama_dir(family)))
    ids = PROMPTS[2] + PROMPTS[0]
    ours = _all_position_logits(cfg, params, ids)
    with torch.no_grad():
        theirs = tiny_llama_model(family)(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers_generate(family):
    llm = LLM(str(tiny_llama_dir(family)), max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=256, warmup=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    model = tiny_llama_model(family)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert len(ref) == 32
        assert out.token_ids == ref
        assert out.finish_reason == "length"
    llm.engine.allocator.check()
    assert llm.engine.allocator.num_allocated == 0


def test_bfloat16_checkpoint_runs_in_bfloat16_close_to_float32():
    cfg, params, _ = load_model(str(tiny_llama_dir("llama3", dtype="bfloat16")))
    assert cfg.dtype == "bfloat16" and params["embed"].dtype == jnp.bfloat16
    ids = PROMPTS[0] + PROMPTS[2]
    ours = _all_position_logits(cfg, params, ids)
    with torch.no_grad():
        theirs = tiny_llama_model("llama3")(torch.tensor([ids])).logits[0].numpy()
    # bf16 weights (rounded from f32) and bf16 activations: a few bf16 ulps of the logit scale.
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() < 0.05 * scale
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() > 0.9

"""gpt-oss's parts one by one (the family against transformers end to end is
test_model_families' matrix, and its ep mesh test_moe's): YaRN RoPE as transformers computes
it, attention sinks as a softmax with one more logit, checkpoint tensors read as views of a
stored one, MXFP4 experts decoded as transformers decodes them, a checkpoint stored
quantized otherwise refused by name, and each of the family's parts moving the tiny
checkpoint's logits (so the parity test would see it broken)."""
from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hf_models import FAMILY_CONFIGS, tiny_llama_dir, tiny_llama_model
from jserve.config import hf_config_fields, inv_frequencies, rope_attention_factor
from jserve.kernels.blocks import with_sinks
from jserve.model import checkpoint_files
from jserve.model.decoder import to_runtime_layout
from jserve.model.families import read_config
from jserve.model.weights import load_model
from test_hf_parity import _all_position_logits

YARNS = [  # gpt-oss's own; truncated (transformers' default); DeepSeek's mscale ratio
    dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
    dict(rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=0.707,
         original_max_position_embeddings=4096, beta_fast=16.0)]


@pytest.mark.parametrize("rope", YARNS)
def test_yarn_frequencies_and_factor_equal_transformers(rope):
    hf = dict(hidden_size=512, num_attention_heads=8, head_dim=64, num_key_value_heads=8,
              num_hidden_layers=1, intermediate_size=64, vocab_size=64,
              max_position_embeddings=131072,
              rope_parameters=dict(rope, rope_theta=150000.0))
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**hf), "cpu")
    cfg = read_config(dict(hf, architectures=["LlamaForCausalLM"]))
    # torch's float32 pow and numpy's differ by an ulp at some exponents (the unscaled
    # frequencies too); a wrong ramp, truncation or factor moves them by far more.
    np.testing.assert_allclose(inv_frequencies(cfg), inv.numpy(), rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(factor, rel=1e-12)
    assert rope_attention_factor(cfg) != 1.0


def test_sinks_are_a_softmax_with_one_more_logit_on_a_zero_value():
    rng = np.random.default_rng(0)
    scores = rng.normal(0, 2, (5, 3, 7)).astype(np.float32)  # [T, H, keys]
    values = rng.normal(0, 1, (5, 3, 7, 4)).astype(np.float32)
    sinks = np.array([-1.0, 0.5, 3.0], np.float32)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    out = np.einsum("thk,thkd->thd", probs / probs.sum(-1, keepdims=True), values)
    lse = np.log(np.exp(scores).sum(-1))
    with_sink = np.concatenate([scores, np.broadcast_to(sinks[None, :, None], (5, 3, 1))], -1)
    p = np.exp(with_sink - with_sink.max(-1, keepdims=True))
    want = np.einsum("thk,thkd->thd", (p / p.sum(-1, keepdims=True))[..., :-1], values)
    got = with_sinks(jnp.asarray(out), jnp.asarray(lse), jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    # A row that saw no key (lse -inf) stays zero, not NaN.
    empty = with_sinks(jnp.zeros((1, 3, 4)), jnp.full((1, 3), -jnp.inf), jnp.asarray(sinks))
    assert np.array_equal(np.asarray(empty), np.zeros((1, 3, 4)))


def test_views_of_a_stored_tensor_read_as_numpy_indexes_it(tmp_path):
    stack = np.arange(3 * 4 * 10, dtype=np.float32).reshape(3, 4, 10)
    bias = np.arange(30, dtype=np.float32).reshape(3, 10)
    save_file({"w": stack, "b": bias}, str(tmp_path / "model.safetensors"))
    views = {"w[2, :, 1::2]": stack[2, :, 1::2], "w[0, :, 0::2]": stack[0, :, 0::2],
             "b[1, None, 0::2]": bias[1, None, 0::2], "b": bias}
    layout = checkpoint_files.view_layout(checkpoint_files.safetensors_layout(tmp_path),
                                          views)
    assert sorted(next(iter(layout.values()))) == sorted(views)  # w and b read as views
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as f:
        for name, want in views.items():
            assert checkpoint_files.shape(f, name) == want.shape, name
            np.testing.assert_array_equal(checkpoint_files.read(f, name), want)
            part = (slice(1, 3), slice(2, 4))  # a tp shard's rows and columns
            np.testing.assert_array_equal(checkpoint_files.read(f, name, part), want[part])
    assert checkpoint_files.view_of("w") is None
    assert checkpoint_files.view_of("w[3, :, 0::2]") == ("w", (3, slice(None), slice(0, None, 2)))


def test_a_checkpoint_stored_quantized_by_another_tool_is_refused_by_name():
    hf = json.loads((tiny_llama_dir("gpt_oss") / "config.json").read_text())
    with pytest.raises(ValueError, match="'gptq'.*--quantization int8 or fp8"):
        hf_config_fields(dict(hf, quantization_config={"quant_method": "gptq", "bits": 4}))
    with pytest.raises(ValueError, match="'fp8'"):
        read_config(dict(hf, quantization_config={"quant_method": "fp8"}))
    read_config(dict(hf, quantization_config={"quant_method": "mxfp4"}))  # decoded at load


def test_mxfp4_experts_decode_as_transformers_does_and_give_its_logits(tmp_path):
    """A gpt-oss checkpoint whose experts are stored as gpt-oss's releases store them
    (MXFP4 ``_blocks``/``_scales``, random bytes): both loaders decode them to what
    transformers' own converter gives, and the logits equal the torch model's with those
    experts."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = transformers.GptOssConfig(**{**FAMILY_CONFIGS["gpt_oss"],
                                          "intermediate_size": 32})  # blocks of 32
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    rng = np.random.default_rng(0)
    for i, layer in enumerate(model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            e, n_in, n_out = tensors.pop(name).shape
            blocks = rng.integers(0, 256, (e, n_out, n_in // 32, 16), dtype=np.uint8)
            scales = rng.integers(119, 124, (e, n_out, n_in // 32), dtype=np.uint8)
            tensors |= {name + "_blocks": blocks, name + "_scales": scales}
            decoded = convert_moe_packed_tensors(torch.from_numpy(blocks),
                                                 torch.from_numpy(scales), dtype=torch.float32)
            getattr(layer.mlp.experts, proj).data.copy_(decoded)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        dict(hf, quantization_config={"quant_method": "mxfp4"})))
    cfg, params, _ = load_model(str(tmp_path))
    experts = model.model.layers[1].mlp.experts
    gate_up = experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(params["layers"][1]["we_gate"], gate_up[..., 0::2])
    np.testing.assert_array_equal(params["layers"][1]["we_up"], gate_up[..., 1::2])
    np.testing.assert_array_equal(params["layers"][1]["we_down"],
                                  experts.down_proj.detach().numpy())
    _, lazy, _ = load_model(str(tmp_path), lazy=True)
    streamed = lazy.place(cfg)["layers"]
    eager = to_runtime_layout(params)["layers"]
    for name in ("we_gate_up", "we_down"):
        np.testing.assert_array_equal(np.asarray(streamed[name]), np.asarray(eager[name]))
    ids = [3 + (7 * j) % 500 for j in range(45)]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_all_position_logits(cfg, params, ids), theirs, atol=1e-4,
                               rtol=1e-4)


def test_each_gpt_oss_part_moves_the_logits():
    """The tiny checkpoint exercises every part: without the clamp, YaRN, its sinks or the
    experts' biases, the logits leave the tolerance the parity test holds them to."""
    cfg, params, _ = load_model(str(tiny_llama_dir("gpt_oss")))
    ids = [3 + (7 * j) % 500 for j in range(45)]
    with torch.no_grad():
        theirs = tiny_llama_model("gpt_oss")(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_all_position_logits(cfg, params, ids), theirs, atol=1e-4,
                               rtol=1e-4)
    zeroed = lambda name: {**params, "layers": [  # noqa: E731
        {**layer, name: jnp.zeros_like(layer[name])} for layer in params["layers"]]}
    broken = {"no clamp": (dataclasses.replace(cfg, swiglu_limit=1e9), params),
              "no yarn": (dataclasses.replace(cfg, rope_scaling=None), params),
              "zero sinks": (cfg, zeroed("sinks")), "no expert biases": (cfg, zeroed("be_up")),
              "no down biases": (cfg, zeroed("be_down"))}
    for what, (c, p) in broken.items():
        assert np.abs(_all_position_logits(c, p, ids) - theirs).max() > 1e-2, what

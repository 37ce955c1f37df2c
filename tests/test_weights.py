"""Loading params from HF safetensors, orbax round trips, and ``load_model`` resolution."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import CONFIGS, tiny_llama_dir, tiny_llama_model
from jserve.config import ModelConfig, RopeScaling
from jserve.model.families import read_config_file
from jserve.model.params import num_params
from jserve.model.weights import (
    DEFAULT_CONFIG,
    LM_HEAD_KEY,
    init_params,
    load_hf_safetensors,
    load_model,
    resolve_model_dir,
    restore_orbax,
    save_orbax,
)
from jserve.tokenizer import ByteTokenizer, HFTokenizer

EXPECTED_CONFIG = {
    "llama2": dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0,
                   rope_scaling=None, tie_word_embeddings=False, eos_token_ids=(2,)),
    "llama3": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                   rope_scaling=None, tie_word_embeddings=False, eos_token_ids=(2, 3)),
    "llama31": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), max_position_embeddings=512,
                    tie_word_embeddings=False, eos_token_ids=(2, 3)),
    "llama32": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                    rope_scaling=RopeScaling(32.0, 1.0, 4.0, 64), max_position_embeddings=512,
                    tie_word_embeddings=True, eos_token_ids=(2, 3)),
}

# Written independently of the loader's own table, so a mapping slip there shows here.
LAYER_NAMES = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
               "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
               "mlp_norm": "post_attention_layernorm", "w_gate": "mlp.gate_proj",
               "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def expected_params(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """The params layout built straight from a torch state_dict, as float32 numpy."""
    def get(name: str) -> np.ndarray:
        t = state_dict[name].float().numpy()
        vocab_rows = ("model.embed_tokens.weight", "lm_head.weight")  # [vocab, hidden] kept
        return t.T if t.ndim == 2 and name not in vocab_rows else t

    params = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight"),
              "layers": [{k: get(f"model.layers.{i}.{v}.weight") for k, v in LAYER_NAMES.items()}
                         for i in range(cfg.num_hidden_layers)]}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight")
    return params


def assert_trees_equal(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a, dtype=np.float32), np.asarray(e, np.float32))


def dtypes(params) -> set:
    return {leaf.dtype for leaf in jax.tree.leaves(params)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_from_hf_json(name: str) -> None:
    cfg = read_config_file(tiny_llama_dir(name) / "config.json")
    for field, value in EXPECTED_CONFIG[name].items():
        assert getattr(cfg, field) == value, field
    assert (cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.dtype) == (64, 16, 512, "float32")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_params_equal_state_dict(name: str) -> None:
    cfg = read_config_file(tiny_llama_dir(name) / "config.json")
    params = load_hf_safetensors(tiny_llama_dir(name), cfg)
    assert ("lm_head" in params) == (not cfg.tie_word_embeddings)
    assert dtypes(params) == {jnp.dtype(jnp.float32)}
    assert_trees_equal(params, expected_params(tiny_llama_model(name).state_dict(), cfg))


def test_sharded_checkpoint_loads_identically() -> None:
    sharded = tiny_llama_dir("llama3", max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) >= 3
    cfg = read_config_file(sharded / "config.json")
    assert_trees_equal(load_hf_safetensors(sharded, cfg),
                       load_hf_safetensors(tiny_llama_dir("llama3"), cfg))


def test_bf16_checkpoint_loads_as_bf16() -> None:
    model_dir = tiny_llama_dir("llama31", dtype="bfloat16")
    cfg = read_config_file(model_dir / "config.json")
    assert cfg.dtype == "bfloat16"
    params = load_hf_safetensors(model_dir, cfg)
    assert dtypes(params) == {jnp.dtype(jnp.bfloat16)}
    state = tiny_llama_model("llama31").state_dict()
    bf16_state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    assert_trees_equal(params, expected_params(bf16_state, cfg))


def test_dtype_override_casts_f32_checkpoint() -> None:
    cfg, params, _ = load_model(str(tiny_llama_dir("llama2")), dtype="bfloat16")
    assert cfg.dtype == "bfloat16" and dtypes(params) == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("name,dtype", [("llama31", "float32"), ("llama32", "bfloat16")])
def test_orbax_round_trip(tmp_path: Path, name: str, dtype: str) -> None:
    src = tiny_llama_dir(name, with_tokenizer=True)
    cfg = read_config_file(src / "config.json", dtype=dtype)
    params = load_hf_safetensors(src, cfg)
    save_orbax(tmp_path / "ckpt", cfg, params, tokenizer_dir=src)
    assert read_config_file(tmp_path / "ckpt" / "config.json") == cfg
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "ckpt" / f).read_bytes() == (src / f).read_bytes()
    restored = restore_orbax(tmp_path / "ckpt", cfg)
    assert dtypes(restored) == {jnp.dtype(dtype)}
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(restored))
    assert_trees_equal(restored, params)

    loaded_cfg, loaded, tokenizer = load_model(str(tmp_path / "ckpt"))
    assert loaded_cfg == cfg and isinstance(tokenizer, HFTokenizer)
    assert_trees_equal(loaded, params)
    cast_cfg, cast, _ = load_model(str(tmp_path / "ckpt"), dtype="bfloat16")
    assert cast_cfg.dtype == "bfloat16" and dtypes(cast) == {jnp.dtype(jnp.bfloat16)}


def test_orbax_checkpoint_with_the_older_lm_head_layout(tmp_path: Path) -> None:
    """A checkpoint saved while the LM head was stored [hidden, vocab] (its config.json
    without ``LM_HEAD_KEY``, as the built-in tiny-tasks model's) restores to [vocab, hidden]."""
    src = tiny_llama_dir("llama31")
    cfg = read_config_file(src / "config.json")
    params = load_hf_safetensors(src, cfg)
    assert params["lm_head"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert cfg.vocab_size != cfg.hidden_size  # the two layouts differ in shape
    save_orbax(tmp_path / "ckpt", cfg, {**params, "lm_head": params["lm_head"].T})
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del config[LM_HEAD_KEY]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    assert_trees_equal(restore_orbax(tmp_path / "ckpt", cfg), params)
    shipped = json.loads((resolve_model_dir("tiny-tasks") / "config.json").read_text())
    assert LM_HEAD_KEY not in shipped and not shipped["tie_word_embeddings"]


def test_init_params_seeded() -> None:
    cfg = DEFAULT_CONFIG
    a, b, c = init_params(cfg, seed=0), init_params(cfg, seed=0), init_params(cfg, seed=1)
    assert_trees_equal(a, b)
    assert not np.array_equal(np.asarray(a["embed"]), np.asarray(c["embed"]))
    assert sum(leaf.size for leaf in jax.tree.leaves(a)) == num_params(cfg)
    assert np.all(np.asarray(a["layers"][0]["attn_norm"]) == 1.0)
    assert abs(float(np.std(np.asarray(a["layers"][0]["w_up"]))) - 0.02) < 1e-3
    bf16 = init_params(dataclasses.replace(cfg, dtype="bfloat16"))
    assert dtypes(bf16) == {jnp.dtype(jnp.bfloat16)}


def test_load_model_default() -> None:
    cfg, params, tokenizer = load_model("default", seed=3)
    assert cfg == DEFAULT_CONFIG and isinstance(tokenizer, ByteTokenizer)
    assert cfg.vocab_size >= tokenizer.vocab_size
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (tokenizer.bos_token_id,
                                                     tokenizer.eos_token_ids)
    assert_trees_equal(params, init_params(DEFAULT_CONFIG, seed=3))
    cfg16, params16, _ = load_model("default", dtype="bfloat16")
    assert cfg16.dtype == "bfloat16" and dtypes(params16) == {jnp.dtype(jnp.bfloat16)}


def test_load_model_hf_dirs() -> None:
    cfg, params, tokenizer = load_model(str(tiny_llama_dir("llama3", with_tokenizer=True)))
    assert cfg.num_key_value_heads == 2 and isinstance(tokenizer, HFTokenizer)
    assert_trees_equal(params, expected_params(tiny_llama_model("llama3").state_dict(), cfg))
    _, sharded, no_tokenizer = load_model(str(tiny_llama_dir("llama3", max_shard_size="50KB")))
    assert no_tokenizer is None
    assert_trees_equal(sharded, params)


def test_load_model_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))
    shutil.copy(tiny_llama_dir("llama2") / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="neither an orbax params/"):
        load_model(str(tmp_path))


def _rewrite_checkpoint(tmp_path: Path, edit) -> Path:
    """A copy of the llama2 checkpoint whose tensors went through ``edit(state_dict)``."""
    src = tiny_llama_dir("llama2")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_missing_and_unexpected_tensors_named(tmp_path: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.1.mlp.extra.weight"] = torch.zeros(2)

    model_dir = _rewrite_checkpoint(tmp_path, edit)
    with pytest.raises(ValueError,
                       match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\], "
                             r"unexpected tensors \['model.layers.1.mlp.extra.weight'\]"):
        load_model(str(model_dir))


def test_wrong_shape_rejected(tmp_path: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)

    with pytest.raises(ValueError, match="k_proj.weight has shape"):
        load_model(str(_rewrite_checkpoint(tmp_path, edit)))


def test_tied_checkpoint_with_redundant_lm_head(tmp_path: Path) -> None:
    """Some tied checkpoints still store lm_head.weight; it is a copy of the embedding."""
    src = tiny_llama_dir("llama32")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(src / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / "model.safetensors")
    _, params, _ = load_model(str(tmp_path))
    assert "lm_head" not in params

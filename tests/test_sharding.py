"""Mesh configs and the tensor-parallel layout. Engines on every mesh against the unsharded
one are in tests/test_mesh_matrix.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jserve.model.decoder import to_runtime_layout
from jserve.model.weights import DEFAULT_CONFIG, init_params
from llm_helpers import small_llm
from sharding.mesh import MeshConfig
from sharding.specs import kv_head_map, tp_layout


def test_parse_names_every_axis():
    assert MeshConfig.parse("tp=2,kvp=2") == MeshConfig(kvp=2, tp=2)
    assert MeshConfig.parse(" dp=2 , spp=3,kvp=1,tp=4 ").shape == (2, 3, 1, 1, 4)
    assert MeshConfig.parse("ep=2,tp=2").shape == (1, 1, 1, 2, 2)
    assert MeshConfig.parse("tp=2,kvp=2").size == 4
    assert MeshConfig.parse(None) == MeshConfig.parse("") == MeshConfig()
    assert MeshConfig().key() == "1" and MeshConfig.parse("tp=2,kvp=2").key() == "kvp2xtp2"
    assert MeshConfig.parse("tp=2,ep=4").key() == "ep4xtp2"


@pytest.mark.parametrize("text, message", [
    ("pp=2", "expected AXIS=N"), ("tp2", "expected AXIS=N"), ("tp=two", "needs an integer"),
    ("tp=0", ">= 1"), ("tp=2,tp=4", "given twice")])
def test_parse_rejects_bad_entries(text, message):
    with pytest.raises(ValueError, match=message):
        MeshConfig.parse(text)


@pytest.mark.parametrize("tp, message", [(3, "num_attention_heads"), (8, "num_attention_heads")])
def test_validate_rejects_splits_the_model_cannot_take(tp, message):
    with pytest.raises(ValueError, match=message):
        MeshConfig(tp=tp).validate(DEFAULT_CONFIG)
    cfg = dataclasses.replace(DEFAULT_CONFIG, num_attention_heads=12, num_key_value_heads=4,
                              intermediate_size=690)
    with pytest.raises(ValueError, match="one must divide the other"):
        MeshConfig(tp=6).validate(cfg)
    with pytest.raises(ValueError, match="intermediate_size"):
        MeshConfig(tp=4).validate(cfg)
    MeshConfig(tp=4).validate(DEFAULT_CONFIG)


def test_engine_rejects_axes_not_implemented():
    with pytest.raises(ValueError, match="dp > 1 not supported yet"):
        small_llm(mesh="dp=2")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_layout_gives_each_shard_its_gate_up_and_kv_heads(tp):
    """A contiguous tp split of the fused leaves gives each shard its own pieces: its gate
    and up columns; its query heads, then the KV heads they read (split at tp <= the KV
    heads, one copy each at tp=4) of k and of v."""
    cfg = DEFAULT_CONFIG
    raw = init_params(cfg, seed=0)
    params = to_runtime_layout(raw)
    ref = raw["layers"][0]
    layer = {k: w[0] for k, w in params["layers"].items()}
    laid = {k: w[0] for k, w in tp_layout(params, cfg, tp)["layers"].items()}
    i, hd = cfg.intermediate_size, cfg.head_dim
    for s, gate_up in enumerate(np.split(np.asarray(laid["w_gate_up"]), tp, axis=1)):
        gate, up = np.split(gate_up, 2, axis=1)
        cols = slice(s * i // tp, (s + 1) * i // tp)
        np.testing.assert_array_equal(gate, layer["w_gate_up"][:, :i][:, cols])
        np.testing.assert_array_equal(up, layer["w_gate_up"][:, i:][:, cols])
    heads = kv_head_map(cfg, tp)  # 2 KV heads: split at tp<=2, one copy per shard at tp=4
    assert list(heads) == {1: [0, 1], 2: [0, 1], 4: [0, 0, 1, 1]}[tp]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    head = lambda w, h: np.asarray(w)[:, h * hd:(h + 1) * hd]
    for s, qkv in enumerate(np.split(np.asarray(laid["wqkv"]), tp, axis=1)):
        q_heads = range(s * cfg.num_attention_heads // tp, (s + 1) * cfg.num_attention_heads // tp)
        kv = sorted({h // group for h in q_heads})
        want = [head(ref["wq"], h) for h in q_heads]
        want += [head(ref[w], h) for w in ("wk", "wv") for h in kv]
        np.testing.assert_array_equal(qkv, np.concatenate(want, axis=1))
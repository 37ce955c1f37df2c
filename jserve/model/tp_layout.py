"""The runtime params' tensor-parallel layout (Megatron): which layer weights a ``tp``-way
split cuts by columns and which by rows, and how wk/wv and w_gate_up columns are reordered
so a contiguous split gives each shard its own pieces.

Every shard must see whole attention groups locally, so shard-local code is the unsharded
model on fewer heads. KV heads are split when ``tp`` divides them; when ``tp`` is larger,
each shard stores a copy of the one KV head its query heads read (vLLM's rule), so no shard
ever gathers another's heads.

No mesh and no JAX here (numpy, or any array with ``reshape`` and indexing): the sharding
layer places params by this layout (``sharding/specs.py``), the streaming loader reads
checkpoint slices in it (``jserve.model.weights.load_hf_runtime``), and ``MeshConfig``
validates a mesh against it without loading JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jserve.config import ModelConfig

# Runtime-layout layer leaves split on tp, by what they are in any family (leaf names are one
# vocabulary: jserve/model/families/base.py): matrices column-split on the last axis or
# row-split on the first (of one layer), biases [out] split like their matrix's columns;
# everything else (norms, q/k norms, embed, lm_head) is replicated. KV_HEAD_COLUMNS' columns
# are KV heads, stored in ``kv_head_map`` order.
COLUMN_SPLIT = ("wq", "wk", "wv", "w_gate_up")
ROW_SPLIT = ("wo", "w_down")
BIAS_SPLIT = ("bq", "bk", "bv")
KV_HEAD_COLUMNS = ("wk", "wv", "bk", "bv")


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raises ValueError when the model cannot be split ``tp`` ways."""
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if hq % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={hq}")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tp={tp} does not divide intermediate_size={cfg.intermediate_size}")
    # Each shard's query heads must share whole KV heads: split them (hkv % tp == 0) or
    # give every shard one copy of the head its group reads (tp % hkv == 0).
    if hkv % tp and tp % hkv:
        raise ValueError(f"tp={tp} and num_key_value_heads={hkv}: one must divide the other")


def kv_head_map(cfg: ModelConfig, tp: int) -> np.ndarray:
    """The global KV head held in each stored KV head slot, shard-major: ``arange(hkv)`` when
    ``tp`` divides the KV heads, else one slot per shard with the head of its query group."""
    hkv = cfg.num_key_value_heads
    if hkv % tp == 0:
        return np.arange(hkv)
    return np.arange(tp) * hkv // tp


def tp_layout_leaf(name: str, w, cfg: ModelConfig, tp: int):
    """One stacked runtime leaf ``[layers, ...]`` (numpy or jax) reordered so a contiguous
    ``tp`` split gives each shard its own pieces: wk/wv (and bk/bv) columns follow
    ``kv_head_map`` and
    ``w_gate_up`` is laid out shard-major as [gate_0, up_0, gate_1, up_1, ...], so every
    shard's half-split still yields its gate slice and the matching up slice. The identity
    at ``tp=1`` and for every other leaf. A quantized leaf (values [layers, in, out] and
    per-output-channel scales [layers, 1, out]) has both reordered by column."""
    if hasattr(w, "qvalue"):  # a qwix QArray (jserve.model.quant), duck-typed: no JAX here
        return dataclasses.replace(w, qvalue=tp_layout_leaf(name, w.qvalue, cfg, tp),
                                   scale=tp_layout_leaf(name, w.scale, cfg, tp))
    if name in KV_HEAD_COLUMNS and tp > 1:  # [layers, (in,) KV heads * head_dim]
        lead = w.shape[:-1]
        heads = w.reshape(*lead, -1, cfg.head_dim)[..., kv_head_map(cfg, tp), :]
        return heads.reshape(*lead, -1)
    n, d, i = w.shape[0], w.shape[1], cfg.intermediate_size  # d: 1 for scales
    if name == "w_gate_up" and tp > 1:
        return w.reshape(n, d, 2, tp, i // tp).transpose(0, 1, 3, 2, 4).reshape(n, d, 2 * i)
    return w


def tp_layout(params: dict[str, Any], cfg: ModelConfig, tp: int) -> dict[str, Any]:
    """Runtime params (``prepare_params``) with every layer leaf in ``tp_layout_leaf``."""
    layers = {name: tp_layout_leaf(name, w, cfg, tp) for name, w in params["layers"].items()}
    return {**params, "layers": layers}


def layer_axes(name: str) -> tuple[str | None, ...]:
    """The mesh axes a stacked layer leaf ``[layers, ...]`` is split over, dim by dim: layers
    by pipeline stage (``"spp"``), then columns or rows on ``"tp"`` (``COLUMN_SPLIT``,
    ``ROW_SPLIT``, ``BIAS_SPLIT``); a ``PartitionSpec(*layer_axes(name))``."""
    if name in COLUMN_SPLIT:
        return ("spp", None, "tp")
    if name in BIAS_SPLIT:
        return ("spp", "tp")
    if name in ROW_SPLIT:
        return ("spp", "tp", None)
    return ("spp",)

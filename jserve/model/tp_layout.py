"""The layer leaves' vocabulary (``LEAVES``: what each kind of leaf is), the runtime params'
column layout: which checkpoint matrices are fused into one runtime leaf (``FUSED``: one
matmul for several), and the tensor-parallel layout (Megatron): which
layer weights a ``tp``-way split cuts by columns and which by rows, and how the columns of
wk/wv and of the fused leaves are ordered so a contiguous split gives each shard its own
pieces (``column_sources``, the one authority the loaders and ``tp_layout_leaf`` read).

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


@dataclasses.dataclass(frozen=True)
class LeafKind:
    """What a layer leaf is, wherever it appears (leaf names are one vocabulary across
    families: jserve/model/families/base.py). ``split``: how tp cuts it, "columns" (the last
    axis), "rows" (the first of a layer), "bias" (an [out] vector split like its matrix's
    columns) or None (replicated); ``matrix``: a projection (quantized, and read in place by
    the indexed layer loop); ``kv_heads``: its columns are KV heads, stored in
    ``kv_head_map`` order; ``parts``: the checkpoint leaves a fused runtime leaf is made of,
    side by side on the output axis, in order (under tp shard-major: [parts of shard 0,
    parts of shard 1, ...]); ``experts``: a stack of one matrix per expert ([experts, in,
    out] a layer), split by tp like one expert's matrix (every shard holds every expert's
    slice: the MoE block's output is then a partial sum like the dense MLP's). A fused
    expert leaf holds every expert's parts side by side on the output axis, [in, experts *
    parts' widths], expert-major ([e0 gate, e0 up, e1 gate, ...]; under tp shard-major):
    one plain matmul reads them all, which XLA:CPU runs without relaying the weights."""

    split: str | None = None
    matrix: bool = False
    kv_heads: bool = False
    parts: tuple[str, ...] = ()
    experts: bool = False
    adapter: bool = False  # a LoRA slot pool leaf (jserve.model.lora): [layers, in,
    # slots * rank] (A, a matrix) or [layers, slots, rank, out] (B), columns the last axis


# The one table of layer leaf kinds: a new kind of leaf is declared here once, and the tp
# layout, quantization and the layer loop read it. Norms (and any leaf not listed) are
# replicated vectors. The fused leaves: the query, key and value projections (one launch for
# three on a GPU decode step), gate and up (1.8x faster MLP at 32 rows on a CPU); gate and
# up alone stay whole (a family always has both: they fuse). The MoE block's leaves
# (jserve/model/moe.py): the router, replicated and never quantized (a rounding there moves
# tokens to other experts), and the experts' gate, up and down stacks, matrices like the
# dense MLP's (quantized with one scale per expert and output channel); Qwen2-MoE's
# shared expert (``ws_``: a dense gated MLP beside the routed ones) and its per-token sigmoid
# gate (``shared_gate``, replicated like the router). gpt-oss's expert biases: ``be_gate``
# and ``be_up`` ([experts, 1, inter]: a matrix of one input row) fused like the matrices,
# so their columns split and gather as those do, and ``be_down`` [experts, hidden], added
# once (``moe.down_bias``); its attention sinks (one logit a query head, split with the
# heads) and its o-projection and router biases (``bo``, ``router_bias``: replicated).
LEAVES: dict[str, LeafKind] = {
    "wq": LeafKind("columns", True),
    "wk": LeafKind("columns", True, kv_heads=True),
    "wv": LeafKind("columns", True, kv_heads=True),
    "wqkv": LeafKind("columns", True, parts=("wq", "wk", "wv")),
    "wo": LeafKind("rows", True),
    "w_gate": LeafKind(None, True),
    "w_up": LeafKind(None, True),
    "w_gate_up": LeafKind("columns", True, parts=("w_gate", "w_up")),
    "w_down": LeafKind("rows", True),
    "router": LeafKind(None),
    "we_gate": LeafKind(None, True, experts=True),
    "we_up": LeafKind(None, True, experts=True),
    "we_gate_up": LeafKind("columns", True, parts=("we_gate", "we_up"), experts=True),
    "we_down": LeafKind("rows", True, experts=True),
    "ws_gate": LeafKind(None, True),
    "ws_up": LeafKind(None, True),
    "ws_gate_up": LeafKind("columns", True, parts=("ws_gate", "ws_up")),
    "ws_down": LeafKind("rows", True),
    "shared_gate": LeafKind(None),
    "be_gate": LeafKind(None, experts=True),
    "be_up": LeafKind(None, experts=True),
    "be_gate_up": LeafKind("columns", parts=("be_gate", "be_up"), experts=True),
    "be_down": LeafKind(None, experts=True),
    "sinks": LeafKind("bias"),
    "bq": LeafKind("bias"),
    "bk": LeafKind("bias", kv_heads=True),
    "bv": LeafKind("bias", kv_heads=True),
}
# LoRA adapter pools (jserve/model/lora.py), split as their target matrix is: a
# column-split target's B by columns (wk/wv's in KV-head order), a row-split target's A by
# rows; the other side replicated. Never quantized (float adapters on int8/fp8 weights).
for _t, _rows in (("wq", False), ("wk", False), ("wv", False), ("wo", True),
                  ("w_gate", False), ("w_up", False), ("w_down", True)):
    LEAVES[f"{_t}.lora_a"] = LeafKind("rows" if _rows else None, adapter=True)
    LEAVES[f"{_t}.lora_b"] = LeafKind(None if _rows else "columns", adapter=True,
                                      kv_heads=_t in ("wk", "wv"))
for _t in ("wqkv", "w_gate_up"):  # the fused targets' A, side by side (replicated)
    LEAVES[f"{_t}.lora_a"] = LeafKind(None, adapter=True)


def _kinds(**want) -> tuple[str, ...]:
    return tuple(n for n, k in LEAVES.items()
                 if all(getattr(k, f) == v for f, v in want.items()))


COLUMN_SPLIT = _kinds(split="columns")
ROW_SPLIT = _kinds(split="rows")
BIAS_SPLIT = _kinds(split="bias")
KV_HEAD_COLUMNS = _kinds(kv_heads=True)
MATRICES = _kinds(matrix=True)
EXPERTS = _kinds(experts=True)
ADAPTERS = _kinds(adapter=True)
FUSED = {n: k.parts for n, k in LEAVES.items() if k.parts}


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raises ValueError when the model cannot be split ``tp`` ways."""
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if hq % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={hq}")
    for name, width in cfg.mlp_widths.items():
        if width % tp:
            raise ValueError(f"tp={tp} does not divide {name}={width}")
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


def fused_in(names) -> dict[str, tuple[str, ...]]:
    """The entries of ``FUSED`` whose parts are all among ``names`` (a family's layer
    leaves: a family without one of them keeps its matrices apart)."""
    return {name: parts for name, parts in FUSED.items() if all(p in names for p in parts)}


def source_widths(name: str, cfg: ModelConfig, tp: int = 1) -> tuple[int, ...]:
    """The columns of each source of the fused leaf ``name`` (``column_sources``' first
    array indexes them): its parts, or for an expert leaf each expert's parts in turn."""
    widths = part_widths(name, cfg, tp)
    return widths * cfg.num_experts if name in EXPERTS else widths


def part_widths(name: str, cfg: ModelConfig, tp: int = 1) -> tuple[int, ...]:
    """The columns of each part of the fused leaf ``name`` as stored for ``tp`` (wk/wv: the
    stored KV heads, ``kv_head_map``), whole (a shard holds 1/tp of each)."""
    return tuple(_width(part, cfg, tp) for part in FUSED[name])


def _width(part: str, cfg: ModelConfig, tp: int) -> int:
    heads = {"wq": cfg.num_attention_heads, "wk": len(kv_head_map(cfg, tp)),
             "wv": len(kv_head_map(cfg, tp))}
    if part in heads:
        return heads[part] * cfg.head_dim
    if part in ("we_gate", "we_up", "be_gate", "be_up"):
        return cfg.expert_size
    if part in ("ws_gate", "ws_up"):
        return cfg.shared_expert_size
    return cfg.intermediate_size  # w_gate, w_up


def column_sources(name: str, cfg: ModelConfig, tp: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, column of that source at tp=1) of each column of the layer leaf ``name`` as
    laid out for ``tp`` (a leaf that is not fused is its own source 0): wk/wv (bk/bv)
    columns follow ``kv_head_map``; a fused leaf is each part's columns (so reordered),
    shard-major; a fused expert leaf's sources are expert e's part p at e * parts + p."""
    if name not in FUSED:
        if name not in KV_HEAD_COLUMNS:
            raise ValueError(f"{name}: no column layout (not fused, not KV heads)")
        heads, hd = kv_head_map(cfg, tp), cfg.head_dim
        cols = np.arange(len(heads) * hd)
        return np.zeros_like(cols), heads[cols // hd] * hd + cols % hd
    pieces = []  # per part: [tp, columns a shard] of (part, source column)
    for p, part in enumerate(FUSED[name]):
        width = _width(part, cfg, tp)
        src = (column_sources(part, cfg, tp)[1] if part in KV_HEAD_COLUMNS
               else np.arange(width))
        pieces.append(np.stack([np.full(width, p), src]).reshape(2, tp, width // tp))
    order = np.concatenate(pieces, axis=-1)  # [2, tp, a shard's columns of every part]
    if name in EXPERTS:  # every expert's parts in turn within each shard
        n = len(FUSED[name])
        order = np.concatenate([order + np.array([e * n, 0])[:, None, None]
                                for e in range(cfg.num_experts)], axis=-1)
    order = order.reshape(2, -1)
    return order[0], order[1]


def tp_layout_leaf(name: str, w, cfg: ModelConfig, tp: int):
    """One stacked runtime leaf ``[layers, ...]`` (numpy or jax; a fused leaf as
    ``decoder.to_runtime_layout`` concatenates it) with its columns in ``column_sources``'s
    order for ``tp``, so a contiguous split gives each shard its own pieces (w_gate_up:
    [gate_0, up_0, gate_1, up_1, ...]). The identity at ``tp=1`` and for every leaf not
    fused and not of KV heads. A quantized leaf (values [layers, in, out] and
    per-output-channel scales [layers, 1, out]) has both reordered by column."""
    if hasattr(w, "qvalue"):  # a qwix QArray (jserve.model.quant), duck-typed: no JAX here
        return dataclasses.replace(w, qvalue=tp_layout_leaf(name, w.qvalue, cfg, tp),
                                   scale=tp_layout_leaf(name, w.scale, cfg, tp))
    if tp == 1 or (name not in FUSED and name not in KV_HEAD_COLUMNS):
        return w
    part, col = column_sources(name, cfg, tp)
    if name in FUSED:  # the sources' offsets in the concatenation (widths at tp=1)
        col = col + np.concatenate([[0], np.cumsum(source_widths(name, cfg))])[part]
    return w[..., col]


def tp_layout(params: dict[str, Any], cfg: ModelConfig, tp: int) -> dict[str, Any]:
    """Runtime params (``to_runtime_layout``) with every layer leaf in ``tp_layout_leaf``."""
    layers = {name: tp_layout_leaf(name, w, cfg, tp) for name, w in params["layers"].items()}
    return {**params, "layers": layers}


def layer_axes(name: str) -> tuple[str | tuple[str, ...] | None, ...]:
    """The mesh axes a stacked layer leaf ``[layers, ...]`` is split over, dim by dim: layers
    by pipeline stage (``"spp"``), then columns or rows on ``"tp"`` (``COLUMN_SPLIT``,
    ``ROW_SPLIT``, ``BIAS_SPLIT``); an expert stack's expert axis on ``"ep"`` (whole experts
    a shard). A fused expert leaf has no expert axis: its columns are tp-shard-major with
    every expert in turn within a shard (``column_sources``), so splitting them over
    ("tp", "ep"), ep the minor axis, gives ep shard j of each tp shard experts j * E / ep
    on, as ``we_down``'s split gives it (and at ep=1 the plain tp split). A
    ``PartitionSpec(*layer_axes(name))``."""
    if name in ADAPTERS and name.endswith("_b"):  # [layers, slots, rank, out]
        return ("spp", None, None, "tp") if name in COLUMN_SPLIT else ("spp",)
    experts = ("ep",) if name in EXPERTS and name not in FUSED else ()
    columns = ("tp", "ep") if name in EXPERTS and name in FUSED else "tp"
    if name in COLUMN_SPLIT:
        return ("spp", *experts, None, columns)
    if name in BIAS_SPLIT:
        return ("spp", "tp")
    if name in ROW_SPLIT:
        return ("spp", *experts, "tp", None)
    return ("spp", *experts)

"""The LoRA pool's shapes for a base model (which of its matrices adapters may target, each
pool leaf's shape, the empty pool on its devices) and one adapter's values for a slot; the
delta itself is ``jserve.model.lora``, which the layers import (this module reads the
families, which import the layers)."""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jserve.config import ModelConfig
from jserve.model.families import family_of
from jserve.model.lora import FUSED_A, TARGETS, a_name, b_name
from jserve.model.tp_layout import kv_head_map, layer_axes, tp_layout_leaf


def pool_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The targets ``cfg``'s family has as plain matrices (an MoE layer's experts are not
    among them: their MLP has no ``w_gate``)."""
    names = family_of(cfg).layer_tensors(cfg)
    return tuple(t for t in TARGETS if t in names)


def target_shape(cfg: ModelConfig, target: str, tp: int = 1) -> tuple[int, int]:
    """(in, out) of ``target`` as the runtime stores it for ``tp`` (wk/wv: its stored KV
    heads, ``kv_head_map``)."""
    d_in, d_out = family_of(cfg).layer_tensors(cfg)[target].shape
    if target in ("wk", "wv"):
        d_out = len(kv_head_map(cfg, tp)) * cfg.head_dim
    return d_in, d_out


def pool_shapes(cfg: ModelConfig, slots: int, rank: int, tp: int = 1
                ) -> dict[str, tuple[int, ...]]:
    """Each pool leaf's global shape (stacked over the layers)."""
    n = cfg.num_hidden_layers
    shapes = {}
    for leaf, parts in a_leaves(cfg).items():
        shapes[a_name(leaf)] = (n, target_shape(cfg, parts[0], tp)[0], len(parts) * slots * rank)
    for t in pool_targets(cfg):
        shapes[b_name(t)] = (n, slots, rank, target_shape(cfg, t, tp)[1])
    return shapes


def a_leaves(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each A leaf of the pool -> the targets it holds: a fused one (``lora.FUSED_A``) where
    the family has all its parts (as ``decoder.to_runtime_layout`` fuses the matrices), else
    one per target."""
    targets = pool_targets(cfg)
    fused = {n: parts for n, parts in FUSED_A.items() if set(parts) <= set(targets)}
    taken = {p for parts in fused.values() for p in parts}
    return {**fused, **{t: (t,) for t in targets if t not in taken}}


def empty_pool(cfg: ModelConfig, slots: int, rank: int, mesh=None) -> dict[str, jax.Array]:
    """The zeroed pool leaves (every slot empty), created where they live: on ``mesh``
    split as ``tp_layout.layer_axes`` says, else on the default device."""
    tp = 1 if mesh is None else mesh.shape["tp"]
    dtype = jnp.dtype(cfg.dtype)
    out = {}
    for name, shape in pool_shapes(cfg, slots, rank, tp).items():
        sharding = None
        if mesh is not None:
            sharding = jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(*layer_axes(name)))
        out[name] = jnp.zeros(shape, dtype, device=sharding)
    return out


def slot_arrays(adapter: Mapping[str, tuple[np.ndarray, np.ndarray]], cfg: ModelConfig,
                rank: int, tp: int, dtype) -> dict[str, np.ndarray]:
    """One adapter's values of every pool leaf for one slot, on the host: A [layers, in,
    rank] and B [layers, rank, out] per target, padded with zeros to the pool's ``rank``
    (and zeros for a target it does not adapt), B's columns in the tp layout of its
    matrix. ``adapter``: target -> (A [layers, in, r], B [layers, r, out], scaled)."""
    out, a_of = {}, {}
    for t in pool_targets(cfg):
        d_in, d_out = target_shape(cfg, t, 1)
        a = np.zeros((cfg.num_hidden_layers, d_in, rank), dtype)
        b = np.zeros((cfg.num_hidden_layers, rank, d_out), dtype)
        if t in adapter:
            ua, ub = adapter[t]
            a[:, :, :ua.shape[-1]] = ua
            b[:, :ub.shape[-2], :] = ub
        a_of[t] = a
        out[b_name(t)] = tp_layout_leaf(t, b, cfg, tp) if t in ("wk", "wv") else b
    for leaf, parts in a_leaves(cfg).items():  # a fused A's parts: [layers, in, parts, rank]
        out[a_name(leaf)] = (a_of[leaf] if parts == (leaf,)
                             else np.stack([a_of[p] for p in parts], axis=-2))
    return out

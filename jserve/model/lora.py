"""LoRA adapters in the step: a device slot pool of adapters beside the base weights, and
each token's delta from its own adapter (many adapters, and the base model, in one step).

The pool is one pair of leaves per target matrix of a layer (``TARGETS``: the attention
projections and the dense MLP's), in the stacked layer dict with the base weights, so the
layer loop, the unrolled layers, tp placement and the programs take them as they take any
leaf: ``"<target>.lora_a"`` [layers, in, slots * rank] (a matrix like the base's, every
slot's columns side by side, read in place as the base's are) and ``"<target>.lora_b"``
[layers, slots, rank, out] (read as [slots * rank, out]: a bitcast, on a TPU too while
the rank is a multiple of its sublane tile, 16 in bf16). ``tp_layout.LEAVES``: a
column-split target's B is split by columns as its matrix is, a row-split target's A by
rows; the rest replicated. An adapter of lower
rank is zero-padded to the pool's rank; its scaling (``lora_alpha / r``, or over sqrt(r)
with rsLoRA) is folded into B when it is written, so a slot's delta is ``(h @ A) @ B``.

Per step, the layer dict carries each token's slot (``SLOTS``, [T] int32; -1: the base
model, no delta). The delta of every token is computed against every slot's A at once and
kept only for its own slot's rank columns (a one-hot mask), then multiplied by every
slot's B: two plain matmuls of ``slots * rank`` inner width, each adapter's weights read
once a step however many tokens use it (punica's BGMV gathers per token, which reads an
adapter once per token; ``scripts/bench_lora.py`` measures the two). Linear in ``h``, so
a tp shard's partial delta of a row-split target sums over tp with the base's.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from jserve.model.layer_weights import LayerOf
from jserve.model.quant import matmul
from jserve.model.tp_layout import FUSED

# The matrices an adapter may target, in jserve's leaf names (families/base.py).
TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
SLOTS = "lora.slots"  # the layer dict's per-token adapter slot while a step runs


def a_name(target: str) -> str:
    return f"{target}.lora_a"


def b_name(target: str) -> str:
    return f"{target}.lora_b"


# Targets whose runtime matrices are fused (``tp_layout.FUSED``: wqkv, w_gate_up) share one A
# leaf, their A's side by side ([in, parts * slots * rank]): one product of h for all.
FUSED_A = {n: parts for n, parts in FUSED.items() if set(parts) <= set(TARGETS)}
POOL_LEAVES = frozenset([n for t in TARGETS for n in (a_name(t), b_name(t))]
                        + [a_name(n) for n in FUSED_A])


def pool_slots(layers) -> int:
    """How many adapter slots the pool in runtime ``layers`` (stacked, unrolled, or a
    pipeline's stages) has; 0 without a pool."""
    first = layers[0] if isinstance(layers, (list, tuple)) else layers
    b = next((w for n, w in first.items() if n in POOL_LEAVES and n.endswith("_b")), None)
    return 0 if b is None else b.shape[-3]  # B: [(layers,) slots, rank, out]


def with_slots(layer: Mapping[str, Any], slots: jax.Array | None) -> Mapping[str, Any]:
    """``layer`` carrying the step's per-token adapter ``slots`` (unchanged for None)."""
    return layer if slots is None else {**layer, SLOTS: slots}


def added(layer: Mapping[str, Any], name: str, h: jax.Array, y: jax.Array) -> jax.Array:
    """``y`` (``h @ layer[name]``) plus each token's adapter delta where the layer has a
    pool for ``name`` (a fused leaf: for its parts, side by side as the leaf's columns are,
    under tp a shard's own) and carries the step's slots; else ``y`` as it is."""
    slots = layer.get(SLOTS)
    parts = FUSED_A.get(name, (name,))
    if slots is None or a_name(name) not in layer:
        return y
    bs = [layer[b_name(p)] for p in parts]
    n, r = _shape(bs[0])[-3:-1]
    xa = matmul(h, layer[a_name(name)])  # [T, parts * slots * rank]
    # Each token keeps its own slot's rank columns of every part: a mask of the flat columns
    # (no reshape of xa, which a TPU's tiled layout would relay).
    own = jnp.arange(xa.shape[-1]) % (n * r) // r == slots[:, None]
    xa = jnp.where(own, xa, 0)
    w = n * r
    deltas = [matmul(xa[:, p * w:(p + 1) * w], _merged(b, -3)) for p, b in enumerate(bs)]
    delta = deltas[0] if len(deltas) == 1 else jnp.concatenate(deltas, axis=-1)
    return y + delta.astype(y.dtype)


def _shape(w) -> tuple[int, ...]:
    return (w.stacked if isinstance(w, LayerOf) else w).shape


def _merged(w, axis: int):
    """``w`` with axes ``axis`` and ``axis + 1`` (slots, rank) as one."""
    def merge(x):
        shape = x.shape
        k = x.ndim + axis
        return x.reshape(shape[:k] + (shape[k] * shape[k + 1],) + shape[k + 2:])
    return LayerOf(merge(w.stacked), w.layer) if isinstance(w, LayerOf) else merge(w)


def write_slot(layers, slot, values: Mapping[str, jax.Array]):
    """Runtime ``layers`` (stacked dict, or the unrolled list) with slot ``slot`` of every
    pool leaf set to ``values`` (``slot_arrays``'s, stacked); jit it with ``layers``
    donated, so the pool is written in place."""
    def put(name, w, v):
        v = v.astype(w.dtype)
        if not name.endswith(".lora_a"):  # B [..., slots, rank, out]
            return jax.lax.dynamic_update_index_in_dim(w, v, slot, w.ndim - 3)
        if v.ndim == w.ndim:  # the slot's rank columns of [..., in, slots * rank]
            return jax.lax.dynamic_update_slice_in_dim(w, v, slot * v.shape[-1], w.ndim - 1)
        parts, r = v.shape[-2:]  # a fused A [..., in, parts * slots * rank]: part by part
        n = w.shape[-1] // (parts * r)
        for p in range(parts):
            w = jax.lax.dynamic_update_slice_in_dim(w, v[..., p, :], (p * n + slot) * r,
                                                    w.ndim - 1)
        return w

    if isinstance(layers, list):
        return [{n: put(n, w, values[n][i]) if n in values else w for n, w in layer.items()}
                for i, layer in enumerate(layers)]
    return {n: put(n, w, values[n]) if n in values else w for n, w in layers.items()}

"""Tensor-parallel layout: how the runtime params and KV pages are reordered and split over
the mesh's ``tp`` axis (Megatron: column-split QKV and gate/up, row-split wo and w_down).

Every shard must see whole attention groups locally, so shard-local code is the unsharded
model on fewer heads. KV heads are split when ``tp`` divides them; when ``tp`` is larger, each
shard stores a copy of the one KV head its query heads read (vLLM's rule), so the KV pages
are always split on ``tp`` and no shard ever gathers another's heads.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jserve.cache.pool import KVCache, kv_cache_shape
from jserve.config import LlamaConfig
from jserve.model.llama import Params

# KV pages [layers, stored KV heads, kvp * pages per group, page_size, head_dim]: layers split
# by pipeline stage, heads on tp, pages on kvp (each KV-cache-parallel group holds its own
# pool; a size-1 axis splits nothing).
from sharding.kv_parallel import STACKED_KV_SPEC

# Runtime-layout leaves split on "tp" (column-split on the last axis, row-split on the first);
# everything else (norms, embed, lm_head) is replicated.
_COLUMN = ("wq", "wk", "wv", "w_gate_up")
_ROW = ("wo", "w_down")


def kv_head_map(cfg: LlamaConfig, tp: int) -> np.ndarray:
    """The global KV head held in each stored KV head slot, shard-major: ``arange(hkv)`` when
    ``tp`` divides the KV heads, else one slot per shard with the head of its query group."""
    hkv = cfg.num_key_value_heads
    if hkv % tp == 0:
        return np.arange(hkv)
    return np.arange(tp) * hkv // tp


def tp_layout_leaf(name: str, w, cfg: LlamaConfig, tp: int):
    """One stacked runtime leaf ``[layers, ...]`` (numpy or jax) reordered so a contiguous
    ``tp`` split gives each shard its own pieces: wk/wv columns follow ``kv_head_map`` and
    ``w_gate_up`` is laid out shard-major as [gate_0, up_0, gate_1, up_1, ...], so every
    shard's half-split still yields its gate slice and the matching up slice. The identity
    at ``tp=1`` and for every other leaf."""
    d, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    n = w.shape[0]
    if name in ("wk", "wv") and tp > 1:
        return w.reshape(n, d, -1, hd)[:, :, kv_head_map(cfg, tp)].reshape(n, d, -1)
    if name == "w_gate_up" and tp > 1:
        return w.reshape(n, d, 2, tp, i // tp).transpose(0, 1, 3, 2, 4).reshape(n, d, 2 * i)
    return w


def tp_layout(params: Params, cfg: LlamaConfig, tp: int) -> Params:
    """Runtime params (``prepare_params``) with every layer leaf in ``tp_layout_leaf``."""
    layers = {name: tp_layout_leaf(name, w, cfg, tp) for name, w in params["layers"].items()}
    return {**params, "layers": layers}


def layer_spec(name: str) -> P:
    """A stacked layer leaf's spec: layers split by pipeline stage (``spp``), then the
    Megatron split on ``tp``."""
    return (P("spp", None, "tp") if name in _COLUMN else P("spp", "tp", None) if name in _ROW
            else P("spp"))


def param_specs(params: Params) -> Params:
    """PartitionSpecs with the structure of runtime-layout ``params`` (stacked layers, or
    the unrolled list of per-layer dicts, whose leaves drop the stacked axis)."""
    layers = params["layers"]
    if isinstance(layers, list):
        per_layer = {name: P(*layer_spec(name)[1:]) for name in layers[0]}
        specs = [per_layer] * len(layers)
    else:
        specs = {name: layer_spec(name) for name in layers}
    return {**{k: P() for k in params if k != "layers"}, "layers": specs}


def kv_cache_specs() -> tuple[P, P]:
    return STACKED_KV_SPEC, STACKED_KV_SPEC


def shard_params(params: Params, cfg: LlamaConfig, mesh: Mesh) -> Params:
    """Runtime params reordered by ``tp_layout`` and placed on ``mesh`` (layers by pipeline
    stage, heads and MLP columns by tp)."""
    params = tp_layout(params, cfg, mesh.shape["tp"])
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params))
    return jax.device_put(params, shardings)


def kv_heads_per_device(cfg: LlamaConfig, tp: int) -> int:
    """KV heads one device stores (``kv_head_map`` split over ``tp``): what sizes its pages."""
    return len(kv_head_map(cfg, tp)) // tp


def allocate_sharded_kv_cache(cfg: LlamaConfig, num_pages: int, page_size: int,
                              mesh: Mesh) -> KVCache:
    """Zeroed stacked KV pages created in place on ``mesh`` (no full copy on one device
    first); ``num_pages`` is the global count, ``kvp`` pools of ``num_pages / kvp``."""
    shape = kv_cache_shape(cfg, num_pages, page_size, len(kv_head_map(cfg, mesh.shape["tp"])))
    sharding = NamedSharding(mesh, STACKED_KV_SPEC)
    zeros = jax.jit(functools.partial(jnp.zeros, shape, cfg.np_dtype), out_shardings=sharding)
    return zeros(), zeros()

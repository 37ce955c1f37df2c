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

from jserve.cache.pool import KVCache
from jserve.config import LlamaConfig
from jserve.model.llama import Params
# KV pages [stored KV heads, kvp * pages per group, page_size, head_dim]: heads split on tp,
# pages on kvp (each KV-cache-parallel group holds its own pool; a size-1 axis splits nothing).
from sharding.kv_parallel import KV_PAGES_SPEC

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


def tp_layout(params: Params, cfg: LlamaConfig, tp: int) -> Params:
    """Runtime params (``prepare_params``) reordered so a contiguous ``tp`` split gives each
    shard its own pieces: wk/wv columns follow ``kv_head_map`` and ``w_gate_up`` is laid out
    shard-major as [gate_0, up_0, gate_1, up_1, ...], so every shard's half-split still yields
    its gate slice and the matching up slice. The identity at ``tp=1``."""
    heads = kv_head_map(cfg, tp)
    d, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        for name in ("wk", "wv"):
            layer[name] = layer[name].reshape(d, -1, hd)[:, heads].reshape(d, -1)
        gate_up = layer["w_gate_up"].reshape(d, 2, tp, i // tp)
        layer["w_gate_up"] = gate_up.transpose(0, 2, 1, 3).reshape(d, 2 * i)
        layers.append(layer)
    return {**params, "layers": layers}


def param_specs(params: Params) -> Params:
    """PartitionSpecs with the structure of runtime-layout ``params``."""
    def spec(name: str) -> P:
        return P(None, "tp") if name in _COLUMN else P("tp", None) if name in _ROW else P()
    return {**{k: P() for k in params if k != "layers"},
            "layers": [{name: spec(name) for name in layer} for layer in params["layers"]]}


def kv_cache_specs(num_layers: int) -> list[tuple[P, P]]:
    return [(KV_PAGES_SPEC, KV_PAGES_SPEC)] * num_layers


def shard_params(params: Params, cfg: LlamaConfig, mesh: Mesh) -> Params:
    """Runtime params reordered by ``tp_layout`` and placed on ``mesh``."""
    params = tp_layout(params, cfg, mesh.shape["tp"])
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params))
    return jax.device_put(params, shardings)


def kv_heads_per_device(cfg: LlamaConfig, tp: int) -> int:
    """KV heads one device stores (``kv_head_map`` split over ``tp``): what sizes its pages."""
    return len(kv_head_map(cfg, tp)) // tp


def allocate_sharded_kv_cache(cfg: LlamaConfig, num_pages: int, page_size: int,
                              mesh: Mesh) -> KVCache:
    """Zeroed KV pages created in place on ``mesh`` (no full copy on one device first);
    ``num_pages`` is the global count, ``kvp`` pools of ``num_pages / kvp``."""
    shape = (len(kv_head_map(cfg, mesh.shape["tp"])), num_pages, page_size, cfg.head_dim)
    sharding = NamedSharding(mesh, KV_PAGES_SPEC)
    zeros = jax.jit(functools.partial(jnp.zeros, shape, cfg.np_dtype), out_shardings=sharding)
    return [(zeros(), zeros()) for _ in range(cfg.num_hidden_layers)]

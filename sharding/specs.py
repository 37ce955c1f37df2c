"""Where the runtime params and KV pages live on the mesh: their ``PartitionSpec``s and the
placement of both (layers split by pipeline stage on ``spp``, heads and MLP columns on
``tp``, KV pages on ``tp`` and ``kvp``). The tensor-parallel reordering the split relies on
is the model's (``jserve/model/tp_layout.py``).
"""
from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jserve.cache.pool import KVCache, kv_cache_shape
from jserve.config import ModelConfig
from jserve.kernels import kv_quant
from jserve.model.params import Params
from jserve.model.quant import leaf_spec
from jserve.model.tp_layout import kv_head_map, layer_axes, tp_layout

# KV pages [layers, stored KV heads, kvp * pages per group, page_size, head_dim]: layers split
# by pipeline stage, heads on tp, pages on kvp (each KV-cache-parallel group holds its own
# pool; a size-1 axis splits nothing).
from sharding.kv_parallel import STACKED_KV_SPEC


def layer_spec(name: str) -> P:
    """A stacked layer leaf's spec: layers split by pipeline stage (``spp``), then the
    Megatron split on ``tp`` (``jserve.model.tp_layout.layer_axes``)."""
    return P(*layer_axes(name))


def param_specs(params: Params) -> Params:
    """PartitionSpecs with the structure of runtime-layout ``params`` (stacked layers, the
    unrolled list of per-layer dicts, whose leaves drop the stacked axis, or the tuple of a
    pipeline stage's layers, ``pipeline.unstack_stages``, whose leaves keep a stage axis)."""
    layers = params["layers"]
    # A quantized leaf gets a spec per leaf (values, scales: jserve.model.quant.leaf_spec).
    if isinstance(layers, tuple):
        specs = tuple({name: leaf_spec(w, layer_spec(name)) for name, w in layer.items()}
                      for layer in layers)
    elif isinstance(layers, list):
        per_layer = {name: leaf_spec(w, P(*layer_spec(name)[1:]))
                     for name, w in layers[0].items()}
        specs = [per_layer] * len(layers)
    else:
        specs = {name: leaf_spec(w, layer_spec(name)) for name, w in layers.items()}
    return {**{k: P() for k in params if k != "layers"}, "layers": specs}


def kv_cache_specs() -> tuple[P, P]:
    return STACKED_KV_SPEC, STACKED_KV_SPEC


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """Runtime params reordered by ``tp_layout`` and placed on ``mesh`` (layers by pipeline
    stage, heads and MLP columns by tp)."""
    params = tp_layout(params, cfg, mesh.shape["tp"])
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params))
    return jax.device_put(params, shardings)


def kv_heads_per_device(cfg: ModelConfig, tp: int) -> int:
    """KV heads one device stores (``kv_head_map`` split over ``tp``): what sizes its pages."""
    return len(kv_head_map(cfg, tp)) // tp


def allocate_sharded_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int,
                              mesh: Mesh, kv_cache_dtype: str = "auto") -> KVCache:
    """Zeroed stacked KV pages created in place on ``mesh`` (no full copy on one device
    first); ``num_pages`` is the global count, ``kvp`` pools of ``num_pages / kvp``. Quantized
    pages' scales ([..., S, 1]) split like their values (the spec covers both leaves)."""
    shape = kv_cache_shape(cfg, num_pages, page_size, len(kv_head_map(cfg, mesh.shape["tp"])))
    sharding = NamedSharding(mesh, STACKED_KV_SPEC)
    zeros = jax.jit(functools.partial(kv_quant.zeros, shape, kv_cache_dtype, cfg.np_dtype),
                    out_shardings=sharding)
    return zeros(), zeros()

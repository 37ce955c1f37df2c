"""The step's arguments without allocating them: the runtime params and the KV pages as
``jax.ShapeDtypeStruct``s placed as the engine places them (nothing allocated, no weight
read), for ``jserve plan`` and for a runner that compiles while the weights load."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from jserve.cache.pool import HybridKV, hybrid_kv_shapes, kv_cache_shape
from jserve.config import ModelConfig
from jserve.kernels import kv_quant
from jserve.model import lora_pool, quant
from jserve.model.decoder import unstack_layers
from jserve.model.params import Params, runtime_param_shapes
from sharding.kv_parallel import STACKED_KV_SPEC
from sharding.mesh import AXES
from sharding.specs import kv_head_map, param_specs


def abstract_params(cfg: ModelConfig, mesh: jax.sharding.Mesh | None,
                    device: jax.Device | None = None, lora: tuple[int, int] | None = None
                    ) -> Params:
    """Runtime-layout params as ``ShapeDtypeStruct``s: split by ``param_specs`` on ``mesh``
    (``tp_layout`` reorders, it never reshapes), or on ``device`` without a mesh; ``lora``
    (slots, rank): with the LoRA pool (``jserve.model.lora_pool``)."""
    shapes = runtime_param_shapes(cfg)
    if lora is not None:
        tp = 1 if mesh is None else mesh.shape["tp"]
        shapes["layers"].update(lora_pool.pool_shapes(cfg, *lora, tp))
    is_shape = lambda x: isinstance(x, tuple)
    if mesh is None:  # one device: a 1-device mesh's specs, so the tp-split leaves are known
        mesh = jax.sharding.Mesh(np.array([device or jax.devices()[0]]).reshape((1,) * len(AXES)),
                                 AXES)
    specs = param_specs(shapes)
    params = jax.tree.map(lambda s, p: jax.ShapeDtypeStruct(s, cfg.np_dtype,
                                                            sharding=NamedSharding(mesh, p)),
                          shapes, specs, is_leaf=is_shape)
    if cfg.quantization != "none":  # int8/fp8 values and per-output-channel scales
        for name, spec in specs["layers"].items():
            if name in quant.QUANTIZED_LEAVES:
                params["layers"][name] = quant.abstract_weight(
                    shapes["layers"][name], cfg.quantization, NamedSharding(mesh, spec),
                    NamedSharding(mesh, quant.scale_spec(spec)))
    return params


def abstract_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int,
                      mesh: jax.sharding.Mesh | None, device: jax.Device | None = None,
                      kv_cache_dtype: str = "auto", local_pages: int | None = None):
    """(k, v) pages as ``ShapeDtypeStruct``s, laid out as the engine allocates them:
    ``num_pages`` per kvp group, stored heads split on tp (``allocate_sharded_kv_cache``),
    stored as ``kv_cache_dtype`` (int8: values and scales). ``local_pages`` (one device):
    two layer groups' (``jserve.cache.pool.HybridKV``)."""
    if local_pages is not None:
        sharding = SingleDeviceSharding(device or jax.devices()[0])
        return HybridKV(*((spec, spec) for spec in (
            kv_quant.abstract(shape, kv_cache_dtype, cfg.np_dtype, sharding)
            for shape in hybrid_kv_shapes(cfg, num_pages, local_pages, page_size))))
    if mesh is None:
        shape = kv_cache_shape(cfg, num_pages, page_size)
        sharding = SingleDeviceSharding(device or jax.devices()[0])
    else:
        shape = kv_cache_shape(cfg, mesh.shape["kvp"] * num_pages, page_size,
                               len(kv_head_map(cfg, mesh.shape["tp"])))
        sharding = NamedSharding(mesh, STACKED_KV_SPEC)
    spec = kv_quant.abstract(shape, kv_cache_dtype, cfg.np_dtype, sharding)
    return spec, spec


def params_on_one_device(cfg: ModelConfig, unroll: bool,
                         device: jax.Device | None = None,
                         lora: tuple[int, int] | None = None) -> Params:
    """The step's params on one device (default: the first local one) as
    ``ShapeDtypeStruct``s (``runtime_params``'s output), from the config alone."""
    device = device or jax.local_devices()[0]
    one = jax.sharding.SingleDeviceSharding(device)
    spec = abstract_params(cfg, None, device, lora)
    if unroll:
        spec = jax.eval_shape(unstack_layers, spec)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), spec)


def params_on_mesh(cfg: ModelConfig, mesh: jax.sharding.Mesh, unroll: bool,
                   lora: tuple[int, int] | None = None) -> Params:
    """The step's params split on ``mesh`` as ``ShapeDtypeStruct``s: with ``unroll`` each
    layer's arrays keep their tp split (``step_program._unstacked``'s output)."""
    spec = abstract_params(cfg, mesh, lora=lora)
    if not unroll:
        return spec
    target = jax.eval_shape(unstack_layers, spec)
    return jax.tree.map(lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                          sharding=NamedSharding(mesh, p)),
                        target, param_specs(target))

"""The engine's LoRA adapters (``EngineConfig.lora``): the slot registry
(``jserve.lora.slots.AdapterSlots``) wired to the base model's reader and to the runner's
device pool (``jserve.model.lora``), the adapters ``--lora-modules`` names registered."""
from __future__ import annotations

import logging

import jax
import numpy as np

from jserve.config import ModelConfig
from jserve.lora.config import LoRAConfig, LoRARequest
from jserve.lora.peft import Adapter, read_adapter
from jserve.lora.slots import AdapterSlots
from jserve.model import lora, lora_pool

log = logging.getLogger(__name__)


def build_adapters(cfg: ModelConfig, config: LoRAConfig | None, runner) -> AdapterSlots | None:
    """The slots over ``runner``'s pool, ``config.modules`` registered (a bad one refuses
    the start, naming it); None without LoRA."""
    if config is None:
        return None
    slots = AdapterSlots(
        config, lambda req: read_adapter(req.lora_name, req.lora_path, cfg,
                                         config.max_lora_rank),
        _writer(cfg, config, runner))
    for i, (name, path) in enumerate(config.modules):
        slots.add(LoRARequest(name, i + 1, path))
    log.info("LoRA: %d adapter slot(s) of rank %d on the device, %d adapter(s) loaded%s",
             config.max_loras, config.max_lora_rank, len(config.modules),
             f" ({', '.join(n for n, _ in config.modules)})" if config.modules else "")
    return slots


def _writer(cfg: ModelConfig, config: LoRAConfig, runner):
    """``write(slot, adapter)``: the adapter's values copied into slot ``slot`` of the
    runner's pool in place (the pool's leaves donated; the base weights untouched)."""
    tp = runner.mesh.shape["tp"] if runner.mesh is not None else 1
    jitted = {}

    def write(slot: int, adapter: Adapter) -> None:
        layers = runner.params["layers"]
        pool = _pool(layers)
        values = lora_pool.slot_arrays(adapter.weights, cfg, config.max_lora_rank, tp, np.float32)
        if "fn" not in jitted:
            shardings = jax.tree.map(lambda w: w.sharding, pool)
            jitted["fn"] = jax.jit(lora.write_slot, donate_argnums=0, out_shardings=shardings)
        new = jitted["fn"](pool, np.int32(slot), values)
        runner.params = {**runner.params, "layers": _with_pool(layers, new)}

    return write


def _pool(layers):
    is_pool = lambda n: n in lora.POOL_LEAVES
    if isinstance(layers, list):
        return [{n: w for n, w in layer.items() if is_pool(n)} for layer in layers]
    return {n: w for n, w in layers.items() if is_pool(n)}


def _with_pool(layers, pool):
    if isinstance(layers, list):
        return [{**layer, **p} for layer, p in zip(layers, pool)]
    return {**layers, **pool}

"""Stream pipeline parallelism (``spp``): the layers split into ``spp`` contiguous stages, one
microbatch per stage, every stage busy on every tick.

Layout. Layer ``s * L/spp + j`` is stage ``s``'s ``j``-th layer. The runtime params are
already stacked ``[L, ...]`` and the KV cache ``[L, KV heads, pages, page_size, head_dim]``
(:mod:`jserve.model.llama`); their leading layer dim is split on ``"spp"``
(``sharding.specs.param_specs``, ``STACKED_KV_SPEC``), so a stage holds only its own layers
and their pages and runs them through the model's layer loop (``layer_loop``). Page ids are
global (one allocator), so every stage stores the same pages for different layers.

Tick. One ``jax.shard_map`` over the whole mesh: stage 0 embeds the new batch, every stage
runs its layers on the microbatch it holds, and the residual stream plus the batch's packed
step buffers move one stage on with a cyclic ``ppermute``. The wrap-around puts the batch
that left the last stage in slot 0 of the carry (stage 0 overwrites slot 0 with the next new
batch), where the caller takes it through ``final_logits`` and sampling. The carry
(``PipelineCarry``) stays on device between ticks; every tick has one shape (the engine's
largest bucket), so the carry's shape is fixed and one executable serves all ticks.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jserve.cache.pool import KVCache
from jserve.config import LlamaConfig
from jserve.kernels.kv_parallel import local_page_table
from jserve.model.llama import Params, embed, layer_loop, rope_tables, step_layer
from sharding.specs import kv_cache_specs, param_specs

STAGE_SPEC = P("spp")                # carry leaves: [spp, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PipelineCarry:
    """What each stage holds between ticks: slot ``s`` is the microbatch entering stage ``s``
    on the next tick (slot 0: the batch that just left the last stage)."""

    x: jax.Array     # [spp, T, hidden] residual stream
    ibuf: jax.Array  # [spp, int_size] the batch's packed int32 step buffer
    fbuf: jax.Array  # [spp, float_size] its packed float32 buffer

    def exiting(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.x[0], self.ibuf[0], self.fbuf[0]


def validate(cfg: LlamaConfig, spp: int) -> None:
    if cfg.num_hidden_layers % spp:
        raise ValueError(f"spp={spp} does not divide num_hidden_layers={cfg.num_hidden_layers}")


def layers_per_stage(cfg: LlamaConfig, spp: int) -> int:
    validate(cfg, spp)
    return cfg.num_hidden_layers // spp


def carry_spec(mesh: Mesh, cfg: LlamaConfig, tokens: int, int_size: int,
               float_size: int) -> PipelineCarry:
    """Abstract carry (shapes and shardings) for lowering the tick."""
    spp = mesh.shape["spp"]
    sharding = NamedSharding(mesh, STAGE_SPEC)
    return PipelineCarry(
        x=jax.ShapeDtypeStruct((spp, tokens, cfg.hidden_size), cfg.np_dtype, sharding=sharding),
        ibuf=jax.ShapeDtypeStruct((spp, int_size), jnp.int32, sharding=sharding),
        fbuf=jax.ShapeDtypeStruct((spp, float_size), jnp.float32, sharding=sharding))


def empty_carry(mesh: Mesh, cfg: LlamaConfig, tokens: int, ibuf, fbuf) -> PipelineCarry:
    """Every slot an empty batch (``ibuf``/``fbuf``: a packed all-padding step, whose writes
    go to the sink page 0 and which samples no row) with a zero residual stream."""
    spp = mesh.shape["spp"]
    sharding = NamedSharding(mesh, STAGE_SPEC)
    tile = lambda b: jnp.tile(jnp.asarray(b)[None], (spp, 1))
    return jax.device_put(PipelineCarry(jnp.zeros((spp, tokens, cfg.hidden_size), cfg.np_dtype),
                                        tile(ibuf), tile(fbuf)), sharding)


def tick(params: Params, kv_cache: KVCache, carry: PipelineCarry, ibuf: jax.Array,
         fbuf: jax.Array, *, unpack: Callable, mesh: Mesh, cfg: LlamaConfig,
         attention_impl: str) -> tuple[KVCache, PipelineCarry]:
    """One pipeline tick with the new batch (``ibuf``, ``fbuf``; replicated) entering stage 0.
    ``unpack(ibuf, fbuf)`` turns packed buffers into ``StepArrays``. Returns the updated KV
    cache and carry; ``carry.exiting()`` is the batch that left the last stage.

    With ``kvp`` > 1 every stage runs KV-cache-parallel attention: the batch travels whole,
    so each group takes its own columns of the page table here (what ``PAGE_TABLE_SPEC``
    does for the unpipelined step)."""
    spp, kvp = mesh.shape["spp"], mesh.shape["kvp"]
    lps = layers_per_stage(cfg, spp)
    kvp_axis = "kvp" if kvp > 1 else None
    perm = [(s, (s + 1) % spp) for s in range(spp)]

    def local(params, kv_cache, carry, ibuf, fbuf):
        first = jax.lax.axis_index("spp") == 0
        ib = jnp.where(first, ibuf, carry.ibuf[0])
        fb = jnp.where(first, fbuf, carry.fbuf[0])
        batch = unpack(ib, fb).batch
        if kvp_axis is not None:
            table = batch.attn.page_table
            local = local_page_table(table, jax.lax.axis_index("kvp"), table.shape[1] // kvp)
            batch = dataclasses.replace(
                batch, attn=dataclasses.replace(batch.attn, page_table=local))
        x = jnp.where(first, embed(params, batch.tokens), carry.x[0])
        cos, sin = rope_tables(cfg, batch.attn.positions)
        layer_fn = step_layer(batch, cos, sin, cfg=cfg, attention_impl=attention_impl,
                              tp_axis="tp", kvp_axis=kvp_axis)
        x, kv_cache, _ = layer_loop(params["layers"], x, kv_cache, layer_fn, 0, lps)
        moved = PipelineCarry(*(jax.lax.ppermute(a, "spp", perm)[None] for a in (x, ib, fb)))
        return kv_cache, moved

    specs = kv_cache_specs()
    carry_specs = PipelineCarry(STAGE_SPEC, STAGE_SPEC, STAGE_SPEC)
    # check_vma off for the same reason as tp_forward (kernel loop carries); replication of
    # the moved carry over tp holds by construction (psum'd residual stream).
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(param_specs(params), specs, carry_specs, P(), P()),
                         out_specs=(specs, carry_specs), check_vma=False)(
        params, kv_cache, carry, ibuf, fbuf)

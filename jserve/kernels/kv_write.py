"""Writing a step's new K or V rows into the paged cache, before attention reads it.

``slots`` are flat cache slots (page * page_size + offset); padding tokens point at the reserved
page 0, which no live sequence reads. The reference is an XLA scatter. The Pallas flavours
update the cache in place (the cache buffer is aliased to the output, and the engine donates
it), touching only the written rows: on GPU each program scatters a block of tokens' rows of
one KV head; on TPU each KV head issues one HBM-to-HBM DMA per token, slots read from SMEM.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu, triton as plgpu

from jserve.kernels import blocks

GPU_BLOCK_TOKENS = 16


def write_kv(pages: jax.Array, slots: jax.Array, new: jax.Array, layer=None) -> jax.Array:
    """Reference: scatter new [T, Hkv, D] into pages [Hkv, P, S, D] at flat slots [T]; with
    ``layer``, into that layer of stacked pages [layers, Hkv, P, S, D] (one scatter, in
    place under a donated or loop-carried buffer)."""
    if layer is None:
        hkv, p, s, d = pages.shape
        flat = pages.reshape(hkv, p * s, d)
        flat = flat.at[:, slots].set(new.transpose(1, 0, 2).astype(pages.dtype))
        return flat.reshape(pages.shape)
    n, hkv, p, s, d = pages.shape
    if slots.shape[0] == 1:
        # XLA turns a one-row scatter into a dynamic-update-slice that copies the whole
        # stacked cache; a second row into the sink page (slot 0) keeps it a scatter.
        slots = jnp.concatenate([slots, jnp.zeros_like(slots)])
        new = jnp.concatenate([new, jnp.zeros_like(new)])
    flat = pages.reshape(n, hkv, p * s, d)
    # Mixed scalar/array indices around a slice put the indexed dims first: [T, Hkv, D].
    flat = flat.at[layer, :, slots].set(new.astype(pages.dtype))
    return flat.reshape(pages.shape)


def _gpu_kernel(layer_ref, slots_ref, new_ref, _, pages_ref):
    pages_ref[layer_ref[0], slots_ref[...]] = new_ref[...].astype(pages_ref.dtype)


def write_kv_gpu(pages: jax.Array, slots: jax.Array, new: jax.Array, *,
                 interpret: bool = False, layer=None) -> jax.Array:
    """Pages [Hkv, P, S, D], or with ``layer`` (may be traced) stacked [L, Hkv, P, S, D]
    written at that layer in place (returned whole): the kernel indexes the layer itself,
    since a slice of the stacked cache would copy the layer's whole pool."""
    pages5, layer = blocks.stacked(pages, layer)
    n, hkv, p, s, d = pages5.shape
    t = slots.shape[0]
    bt = GPU_BLOCK_TOKENS
    pad = -t % bt
    slots = jnp.pad(slots, (0, pad))  # the extra rows go to the sink page 0
    new = jnp.pad(new.transpose(1, 0, 2), ((0, 0), (0, pad), (0, 0)))
    out = pl.pallas_call(
        _gpu_kernel,
        grid=(hkv, (t + pad) // bt),
        in_specs=[pl.BlockSpec((1,), lambda h, i: (0,)),
                  pl.BlockSpec((bt,), lambda h, i: (i,)),
                  pl.BlockSpec((None, bt, d), lambda h, i: (h, i, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((n, None, p * s, d), lambda h, i: (0, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((n, hkv, p * s, d), pages.dtype),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1),  # Triton, not Mosaic GPU
        interpret=interpret,
        name="kv_write_gpu",
    )(layer, slots, new, pages5.reshape(n, hkv, p * s, d))
    return out.reshape(pages.shape)


def _tpu_kernel(layer_ref, slots_ref, new_hbm, _, pages_hbm, sem):
    h, layer = pl.program_id(0), layer_ref[0]

    def copy(t):
        return pltpu.make_async_copy(new_hbm.at[h, pl.ds(t, 1)],
                                     pages_hbm.at[layer, h, pl.ds(slots_ref[t], 1)], sem)

    n = slots_ref.shape[0]
    jax.lax.fori_loop(0, n, lambda t, c: (copy(t).start(), c)[1], 0)
    jax.lax.fori_loop(0, n, lambda t, c: (copy(t).wait(), c)[1], 0)


def write_kv_tpu(pages: jax.Array, slots: jax.Array, new: jax.Array, *,
                 interpret: bool = False, layer=None) -> jax.Array:
    """As :func:`write_kv_gpu`: one layer's pages, or a stacked cache written at ``layer``."""
    pages5, layer = blocks.stacked(pages, layer)
    n, hkv, p, s, d = pages5.shape
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        _tpu_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(hkv,), in_specs=[any_spec, any_spec],
            out_specs=any_spec, scratch_shapes=[pltpu.SemaphoreType.DMA(())]),
        out_shape=jax.ShapeDtypeStruct((n, hkv, p * s, d), pages.dtype),
        input_output_aliases={3: 0},  # operand 3 counts the scalar-prefetched layer, slots
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="kv_write_tpu",
    )(layer, slots, new.transpose(1, 0, 2).astype(pages.dtype), pages5.reshape(n, hkv, p * s, d))
    return out.reshape(pages.shape)

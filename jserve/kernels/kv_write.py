"""Writing a step's new K or V rows into the paged cache, before attention reads it.

``slots`` are flat cache slots (page * page_size + offset); padding tokens point at the reserved
page 0, which no live sequence reads. The reference is an XLA scatter. The Pallas flavours
update the cache in place (the cache buffer is aliased to the output, and the engine donates
it): on GPU each program scatters a block of tokens' rows of one KV head. On TPU (slots read
from SMEM) a DMA must start at a whole sublane tile of the cache's second-minor (slot) dim
wherever a tile row is not contiguous: 32-bit pages take one HBM-to-HBM DMA per token's row;
bf16 and 8-bit pages pack two or four rows into each 32-bit word, so their kernel copies the
aligned block of rows holding each slot into VMEM, writes the rows there and copies it back
(rows beside the written ones come back as they were; a block a run of new rows covers is
not read). Mosaic checks the alignment only when compiling for a TPU, not when lowering.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
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


def gpu_slots(slots: jax.Array) -> jax.Array:
    """``slots`` padded to the GPU kernel's blocks of tokens, the extra rows to the sink page
    0 (a step pads them once for every layer's write)."""
    return jnp.pad(slots, (0, -slots.shape[0] % GPU_BLOCK_TOKENS))


def _gpu_kernel(layer_ref, slots_ref, *refs):
    m = len(refs) // 3  # new rows, the pages as passed (aliased, unread), the pages written
    for new_ref, pages_ref in zip(refs[:m], refs[2 * m:]):
        pages_ref[layer_ref[0], slots_ref[...]] = new_ref[...].astype(pages_ref.dtype)


def write_kv_gpu(pages, slots: jax.Array, new, *, interpret: bool = False, layer=None):
    """Pages [Hkv, P, S, D], or with ``layer`` (may be traced) stacked [L, Hkv, P, S, D]
    written at that layer in place (returned whole): the kernel indexes the layer itself,
    since a slice of the stacked cache would copy the layer's whole pool. ``pages`` and
    ``new`` may be tuples of as many arrays (K and V, their scales: each its own last dim),
    written at the same slots in one launch. ``slots`` may run past the new rows (to the
    sink page: ``gpu_slots``)."""
    if not isinstance(pages, tuple):
        return write_kv_gpu((pages,), slots, (new,), interpret=interpret, layer=layer)[0]
    stacked, layer = blocks.stacked(pages, layer)
    n, hkv, p, s, _ = stacked[0].shape
    slots = gpu_slots(slots)
    t = slots.shape[0]
    bt = GPU_BLOCK_TOKENS
    new = [jnp.pad(x.transpose(1, 0, 2), ((0, 0), (0, t - x.shape[0]), (0, 0))) for x in new]
    flat = [x.reshape(n, hkv, p * s, x.shape[-1]) for x in stacked]
    m = len(flat)
    out = pl.pallas_call(
        _gpu_kernel,
        grid=(hkv, t // bt),
        in_specs=[pl.BlockSpec((1,), lambda h, i: (0,)),
                  pl.BlockSpec((bt,), lambda h, i: (i,)),
                  *[pl.BlockSpec((None, bt, x.shape[-1]), lambda h, i: (h, i, 0)) for x in new],
                  *[pl.BlockSpec(memory_space=pl.ANY)] * m],
        out_specs=[pl.BlockSpec((n, None, p * s, x.shape[-1]), lambda h, i: (0, h, 0, 0))
                   for x in flat],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
        input_output_aliases={2 + m + i: i for i in range(m)},
        compiler_params=plgpu.CompilerParams(num_warps=1),  # Triton, not Mosaic GPU
        interpret=interpret,
        name="kv_write_gpu",
    )(layer, slots, *new, *flat)
    return tuple(o.reshape(x.shape) for o, x in zip(out, pages))


# The TPU kernels address the cache as it is stored, [L, Hkv, P, S, D] or [Hkv, P, S, D]
# (a slot is its page and row): a block never crosses a page, whatever tile XLA gives the
# page's rows (a page of S = 4 rows is tiled by 4), and one layer's pages are not made a
# stack of one (XLA then copied the scales' [Hkv, P, S, 1] around the kernel).
# Mosaic takes its operands row-major: a cache XLA lays out otherwise (its TPU default for a
# minor dim under 128: head dim 64, the scales' 1) comes through a copy, as for attention.
TPU_CHUNK_TOKENS = 256  # tokens per grid step of the read-modify-write kernel
_TPU_STAGING_BYTES = 4 << 20  # its VMEM copies of the blocks a step updates, at most
_BITS = {2: jnp.uint16, 1: jnp.int8}  # the integer type of a packed dtype's width


def _head(pages_hbm, layer_ref, h):
    """The pages [P, S, D] of KV head ``h`` (at the layer, in a stacked cache)."""
    return pages_hbm.at[layer_ref[0], h] if len(pages_hbm.shape) == 5 else pages_hbm.at[h]


def _tpu_row_kernel(layer_ref, slots_ref, new_hbm, _, pages_hbm, sem, *, page_size):
    """32-bit pages: a row of a (8, 128) tile is contiguous, so each token's row is one
    HBM-to-HBM DMA at any slot."""
    h = pl.program_id(0)
    head = _head(pages_hbm, layer_ref, h)

    def copy(t):
        slot = slots_ref[t]
        # lax.div / rem: slots are >= 0, and Mosaic lowers ``//``'s sign fix-up only on a TPU
        page, row = jax.lax.div(slot, page_size), jax.lax.rem(slot, page_size)
        return pltpu.make_async_copy(new_hbm.at[h, pl.ds(t, 1)],
                                     head.at[page, pl.ds(row, 1)], sem)

    n = slots_ref.shape[0]
    jax.lax.fori_loop(0, n, lambda t, c: (copy(t).start(), c)[1], 0)
    jax.lax.fori_loop(0, n, lambda t, c: (copy(t).wait(), c)[1], 0)


def tpu_block_rows(page_size: int, dtype) -> int:
    """Rows of the block the read-modify-write kernel moves for a packed (16- or 8-bit)
    dtype: the dtype's sublane tile (16 rows of bf16, 32 of an 8-bit type), whose offsets
    are multiples of any tile XLA gives the cache (8 to 32 rows), or the whole page where
    the page is not a multiple of it (offset 0)."""
    tile = 8 * (4 // np.dtype(dtype).itemsize)
    return tile if page_size % tile == 0 else page_size


def _block(head, key, page_size: int, rows: int):
    """The ``key``-th block of ``rows`` rows of one head's pages [P, S, D]."""
    first = key * rows
    page = jax.lax.div(first, page_size)
    if rows == page_size:
        return head.at[page]
    row = pl.multiple_of(jax.lax.rem(first, page_size), rows)
    return head.at[page, pl.ds(row, rows)]


def _walk(visit, *, starts, covers, rows: int, chunk: int) -> None:
    """visit(i, last, j, starts, full) over a grid step's tokens, a covering run's ``rows``
    tokens (i to last) at once: j counts the runs (``covers(i)``: the run at i covers its
    block; never where a step has fewer tokens)."""
    def body(carry):
        i, j = carry
        s = starts(i)
        j = j + s.astype(jnp.int32)
        full = s & covers(i)
        last = jnp.where(full, i + rows - 1, i)
        visit(i, last, j, s, full)
        return last + 1, j

    jax.lax.while_loop(lambda c: c[0] < chunk, body, (jnp.int32(0), jnp.int32(-1)))


def _tpu_block_kernel(layer_ref, slots_ref, full_ref, new_ref, _, pages_hbm, buf, sem_in,
                      sem_out, *, page_size, rows, chunk):
    """Packed pages: two (bf16) or four (8-bit) rows share each 32-bit word of a tile, so a
    row alone is no DMA. A grid step takes ``chunk`` tokens sorted by slot (the tokens of one
    block consecutive, a run), copies each run's block into VMEM (``buf[j]`` for the j-th run;
    all copies in flight at once), writes the run's rows into it in token order, and copies it
    back; a run whose tokens cover the block (``full_ref``, where it starts) skips the read
    and writes the block from its ``rows`` new rows at once. Runs of one grid step never
    share a block; a block split between two steps is written back by the first (waited on)
    before the second reads it. ``new_ref`` [chunk, D] holds the rows' bits as int32 (a
    packed row at a dynamic sublane offset has no load)."""
    head = _head(pages_hbm, layer_ref, pl.program_id(0))
    base = pl.program_id(1) * chunk
    dtype = pages_hbm.dtype
    bits = _BITS[np.dtype(dtype).itemsize]

    def key(i):  # the block of the i-th token of this step
        return jax.lax.div(slots_ref[base + i], rows)

    def starts(i):
        return (i == 0) | (key(i) != key(jnp.maximum(i - 1, 0)))

    def ends(i):
        return (i == chunk - 1) | (key(i) != key(jnp.minimum(i + 1, chunk - 1)))

    def fetch(i, j):
        return pltpu.make_async_copy(_block(head, key(i), page_size, rows), buf.at[j], sem_in)

    def store(i, j):
        return pltpu.make_async_copy(buf.at[j], _block(head, key(i), page_size, rows),
                                     sem_out)

    def as_rows(x):  # int32 bits -> the pages' dtype
        return jax.lax.bitcast_convert_type(x.astype(bits), dtype)

    walk = functools.partial(_walk, starts=starts, covers=lambda i: full_ref[base + i] != 0,
                             rows=rows, chunk=chunk)

    def fetches(wait):
        def visit(i, last, j, s, full):
            @pl.when(s & jnp.logical_not(full))
            def _():
                copy = fetch(i, j)
                copy.wait() if wait else copy.start()

        return visit

    # Every read in flight at once; all waited on before any block is read (copies sharing
    # a semaphore may finish in any order: a wait counts bytes, not which copy).
    walk(fetches(wait=False))
    walk(fetches(wait=True))
    row_ids = jax.lax.broadcasted_iota(jnp.int32, (rows, buf.shape[-1]), 0)

    def update(i, last, j, s, full):
        if chunk >= rows:
            @pl.when(full)
            def _():
                buf[j] = as_rows(new_ref[pl.ds(i, rows), :])

        @pl.when(jnp.logical_not(full))
        def _():
            at = row_ids == jax.lax.rem(slots_ref[base + i], rows)
            buf[j] = jnp.where(at, jnp.broadcast_to(as_rows(new_ref[pl.ds(i, 1), :]),
                                                    at.shape), buf[j])

        @pl.when(ends(last))
        def _():
            store(last, j).start()

    def drain(i, last, j, s, full):
        @pl.when(ends(last))
        def _():
            store(last, j).wait()

    walk(update)
    walk(drain)


def _tpu_rows(pages, interpret):
    hkv, s = pages.shape[-4], pages.shape[-2]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_tpu_row_kernel, page_size=s),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(hkv,), in_specs=[any_spec, any_spec],
            out_specs=any_spec, scratch_shapes=[pltpu.SemaphoreType.DMA(())]),
        out_shape=jax.ShapeDtypeStruct(pages.shape, pages.dtype),
        input_output_aliases={3: 0},  # operand 3 counts the scalar-prefetched layer, slots
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="kv_write_tpu",
    )


def _tpu_blocks(pages, slots, new, interpret):
    """(the read-modify-write kernel's call, its scalar and row operands)."""
    hkv, s, d = pages.shape[-4], pages.shape[-2], pages.shape[-1]
    dtype = pages.dtype
    rows = tpu_block_rows(s, dtype)
    t = slots.shape[0]
    per_token = rows * max(d, 128) * dtype.itemsize  # a VMEM block pads D to the lanes
    cap = max(8, min(TPU_CHUNK_TOKENS, _TPU_STAGING_BYTES // per_token) // 8 * 8)
    chunk = t if t <= cap else cap
    pad = -t % chunk
    # Extra tokens write zeros to slot 0 (the sink page). Sorting (stable) puts the tokens of
    # a block next to each other, in their order: the last of equal slots wins.
    slots = jnp.pad(slots, (0, pad))
    order = jnp.argsort(slots, stable=True)
    slots = slots[order]
    bits = jax.lax.bitcast_convert_type(new.astype(dtype), _BITS[dtype.itemsize])
    bits = jnp.pad(bits.astype(jnp.int32), ((0, pad), (0, 0), (0, 0)))[order]
    # A run starting at token i covers its block when i's slot starts the block and the next
    # rows - 1 tokens of its grid step are the next slots.
    tp = t + pad
    i = jnp.arange(tp)
    step = jnp.concatenate([slots[1:] == slots[:-1] + 1, jnp.zeros(1, bool)])
    ahead = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(step, dtype=jnp.int32)])
    fits = i % chunk + rows <= chunk
    full = ((slots % rows == 0) & fits
            & (ahead[jnp.minimum(i + rows - 1, tp)] - ahead[i] == rows - 1))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        functools.partial(_tpu_block_kernel, page_size=s, rows=rows, chunk=chunk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(hkv, tp // chunk),
            in_specs=[pl.BlockSpec((None, chunk, d), lambda h, c, *_: (h, c, 0)), any_spec],
            out_specs=any_spec,
            scratch_shapes=[pltpu.VMEM((chunk, rows, d), dtype),
                            pltpu.SemaphoreType.DMA(()), pltpu.SemaphoreType.DMA(())]),
        out_shape=jax.ShapeDtypeStruct(pages.shape, dtype),
        input_output_aliases={4: 0},  # after the layer, slots, full flags and rows
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kv_write_tpu",
    )
    return call, (slots, full.astype(jnp.int32), bits.transpose(1, 0, 2))


def write_kv_tpu(pages: jax.Array, slots: jax.Array, new: jax.Array, *,
                 interpret: bool = False, layer=None) -> jax.Array:
    """As :func:`write_kv_gpu`: one layer's pages, or a stacked cache written at ``layer``.
    32-bit pages take one DMA per token; 16- and 8-bit pages a read-modify-write of the
    aligned block holding each token's slot (``_tpu_block_kernel``)."""
    layer = jnp.zeros((1,), jnp.int32) if layer is None else blocks.stacked(pages, layer)[1]
    if pages.dtype.itemsize == 4:
        call = _tpu_rows(pages, interpret)
        operands = (slots, new.transpose(1, 0, 2).astype(pages.dtype))
    else:
        call, operands = _tpu_blocks(pages, slots, new, interpret)
    return call(layer, *operands, pages)

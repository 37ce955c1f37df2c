"""Ragged paged attention for TPUs: Pallas lowered to Mosaic.

One launch covers the whole batch, decodes and prefill chunks alike: grid (KV head, query
block), ``tokens_per_block`` tokens per query block (see :mod:`jserve.kernels.blocks`). The
page table, context lengths and per-block sequence ranges ride in SMEM through scalar
prefetch (``PrefetchScalarGridSpec``), so the kernel computes every page address itself. The
cache stays in HBM (``pl.ANY``); the kernel copies ``pages_per_block`` pages per KV step into
one of two VMEM buffers with async DMAs, starting step j+1's copies before computing on step
j's buffer (double buffering), so the MXU works while the next KV page is in flight.

The serving step's stacked cache [layers, Hkv, P, S, D] is handed over whole with the layer
index (scalar-prefetched like the page table): the DMAs address that layer's pages, so no
slice of the stacked cache (a copy of the layer's pool) is made.

Quantized pages (``jserve.kernels.kv_quant``) travel as stored (int8 or fp8, and the int8
rows' scales, DMA'd beside their pages) and are dequantized in VMEM, to q's dtype.

Limit: the flattened page table must fit SMEM (a few hundred thousand entries).
The reference for this kernel is :func:`jserve.kernels.reference.ragged_paged_attention`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jserve.kernels import blocks, kv_quant
from jserve.kernels.metadata import AttentionMetadata

PAGES_PER_BLOCK = 4
BLOCK_ROWS = 128


def _kernel(layer_ref, seq_lo_ref, seq_hi_ref, tok_pos_ref, q_end_ref, q_start_ref,  # SMEM
            kv_lens_ref, table_ref, q_ref, seq_ref, pos_ref, k_hbm, v_hbm, *refs,
            pages_per_block, width, tokens_per_block, scale, windowed):
    # layer_ref: [layer] or, with ``windowed``, [layer, window]; q_start_ref is read only then.
    # refs: [ks_hbm, vs_hbm] (int8 pages' scales), o_ref, lse_ref (outputs), k_buf, v_buf,
    # [ks_buf, vs_buf], sem (scratch).
    quantized = len(refs) == 9
    if quantized:
        ks_hbm, vs_hbm, o_ref, lse_ref, k_buf, v_buf, ks_buf, vs_buf, sem = refs
        pairs = ((k_hbm, k_buf), (v_hbm, v_buf), (ks_hbm, ks_buf), (vs_hbm, vs_buf))
    else:
        o_ref, lse_ref, k_buf, v_buf, sem = refs
        pairs = ((k_hbm, k_buf), (v_hbm, v_buf))
    h, b = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    rows, d = q_ref.shape
    page_size = k_hbm.shape[3]
    chunk = pages_per_block * page_size
    q, row_seq, row_pos = q_ref[...], seq_ref[...], pos_ref[...]
    window = layer_ref[1] if windowed else None

    def copies(s, j, slot, first_page):
        """The DMAs bringing KV block j of sequence s into buffer ``slot``; a page before
        ``first_page`` (the window's) is not read: that one is, again, in its place."""
        out = []
        for i in range(pages_per_block):
            col = j * pages_per_block + i
            page = table_ref[s * width + (jnp.maximum(col, first_page) if windowed else col)]
            for src, dst in pairs:
                out.append(pltpu.make_async_copy(
                    src.at[layer, h, page], dst.at[slot, pl.ds(i * page_size, page_size)],
                    sem.at[slot]))
        return out

    def per_seq(s, carry):
        kv_end = blocks.causal_end(b, s, tok_pos_ref, q_end_ref, kv_lens_ref[s],
                                   tokens_per_block)
        n = pl.cdiv(kv_end, chunk)
        first_page = j0 = 0  # a window's loop starts at the block of its first page
        if windowed:
            first_page = blocks.window_first_page(b, s, tok_pos_ref, q_start_ref, window,
                                                  page_size, tokens_per_block)
            j0 = jax.lax.div(first_page, jnp.int32(pages_per_block))

        @pl.when(n > j0)
        def _():
            for c in copies(s, j0, j0 % 2, first_page):
                c.start()

        def per_block(j, carry):
            slot = j % 2

            @pl.when(j + 1 < n)
            def _():
                for c in copies(s, j + 1, 1 - slot, first_page):
                    c.start()

            for c in copies(s, j, slot, first_page):
                c.wait()
            kv_pos = j * chunk + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
            valid = (row_seq == s) & (kv_pos <= row_pos)
            if windowed:
                valid &= kv_pos >= blocks.window_start(row_pos, window)
            if quantized:  # dequantized in VMEM, to q's dtype for the MXU
                k = (k_buf[slot].astype(jnp.float32) * ks_buf[slot]).astype(q.dtype)
                v = (v_buf[slot].astype(jnp.float32) * vs_buf[slot]).astype(q.dtype)
            else:
                k, v = k_buf[slot].astype(q.dtype), v_buf[slot].astype(q.dtype)
            return blocks.attend_block(carry, q, k, v, valid, scale)

        return jax.lax.fori_loop(j0, n, per_block, carry)

    carry = jax.lax.fori_loop(seq_lo_ref[b], seq_hi_ref[b], per_seq,
                              blocks.init_carry(rows, d))
    out, lse = blocks.finish(*carry)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def row_layouts(meta: AttentionMetadata, group: int, block_rows: int = BLOCK_ROWS
                ) -> tuple[blocks.RowLayout, ...]:
    """The layout of this kernel's one launch (``blocks.RowLayout``), for a step to make once
    before its layer loop (``meta.row_layouts``)."""
    return (blocks.row_layout(meta.positions, meta.token_seq,
                              meta.num_decodes + meta.num_prefills, meta.page_table.shape[0],
                              group, max(1, block_rows // group)),)


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           meta: AttentionMetadata, *, interpret: bool = False,
                           pages_per_block: int = PAGES_PER_BLOCK, block_rows: int = BLOCK_ROWS,
                           layer=None, window=None) -> tuple[jax.Array, jax.Array]:
    """Same contract as the reference: (out [T, Hq, D] in q's dtype, lse [T, Hq] float32).
    Pages are one layer's [Hkv, P, S, D], or with ``layer`` (may be traced) a stacked cache
    [layers, Hkv, P, S, D] read at that layer in place. ``window``: the sliding window (as the
    reference's): each (sequence, query block) starts its DMAs at its first row's window
    block and never copies a page before the window's first page."""
    (k_pages, v_pages), layer = blocks.stacked((k_pages, v_pages), layer)
    windowed = window is not None
    if windowed:
        layer = jnp.concatenate([layer, jnp.asarray(window, jnp.int32).reshape(1)])
    t, hq, d = q.shape
    _, hkv, _, page_size, _ = k_pages.shape
    (k_values, k_scales), (v_values, v_scales) = map(kv_quant.split, (k_pages, v_pages))
    g = hq // hkv
    width = meta.page_table.shape[1]
    pages_per_block = min(pages_per_block, width)
    if width % pages_per_block:
        raise ValueError(f"page table width {width} is not a multiple of {pages_per_block}")
    bt = max(1, block_rows // g)
    lay = blocks.find_layout(meta.row_layouts, 0, t, g, bt) or \
        row_layouts(meta, g, block_rows)[0]
    qb = blocks.block_rows(q, lay)
    _, nb, rows, _ = qb.shape
    chunk = pages_per_block * page_size
    kernel = functools.partial(_kernel, pages_per_block=pages_per_block, width=width,
                               tokens_per_block=bt, scale=d ** -0.5, windowed=windowed)
    per_row = pl.BlockSpec((None, rows, 1), lambda h, b, *_: (b, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kv, kv_specs = [k_values, v_values], [hbm, hbm]
    buffers = [pltpu.VMEM((2, chunk, d), k_values.dtype), pltpu.VMEM((2, chunk, d), v_values.dtype)]
    if k_scales is not None:
        kv += [k_scales, v_scales]
        kv_specs += [hbm, hbm]
        buffers += [pltpu.VMEM((2, chunk, 1), k_scales.dtype)] * 2
    # Without a window q_end stands in for q_start (unread), so nothing new is computed.
    scalars = (layer, lay.seq_lo, lay.seq_hi, lay.tok_pos, lay.q_end,
               lay.q_start if windowed else lay.q_end, meta.kv_lens,
               meta.page_table.reshape(-1))
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(hkv, nb),
            in_specs=[pl.BlockSpec((None, None, rows, d), lambda h, b, *_: (h, b, 0, 0)),
                      per_row, per_row, *kv_specs],
            out_specs=[pl.BlockSpec((None, None, rows, d), lambda h, b, *_: (h, b, 0, 0)),
                       pl.BlockSpec((None, None, rows, 1), lambda h, b, *_: (h, b, 0, 0))],
            scratch_shapes=[*buffers, pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct((hkv, nb, rows, d), q.dtype),
                   jax.ShapeDtypeStruct((hkv, nb, rows, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(*scalars, qb, lay.seq[..., None], lay.pos[..., None], *kv)
    return blocks.unblock(out, t, g, bt), blocks.unblock(lse[..., 0], t, g, bt)

"""Ragged paged attention for GPUs: Pallas lowered to Triton.

Grid (KV head, query block, KV split); the KV loop runs inside the kernel, gathering
``pages_per_block`` pages of the head's cache per step straight from HBM (Triton keeps the
tiles in registers/shared memory; no staging copies). A query block covers
``tokens_per_block`` consecutive tokens times the G query heads sharing the KV head (see
:mod:`jserve.kernels.blocks`), so GQA reads each KV page once per group.

Decodes and prefill chunks are two launches of the same kernel with different blocking:
decodes one token (one sequence) per block, prefill chunks ``prefill_block_rows / G`` tokens
per block. Either launch splits the KV range of each block into parts run by separate
programs (split-K) when it has too few programs to fill the GPU (a small decode batch, a short
chunk at a long context); the parts are merged on their log-sum-exps.
Quantized pages (``jserve.kernels.kv_quant``) are read as stored (int8 or fp8, plus the int8
rows' scales) and dequantized per KV page in the kernel, to q's dtype for the matmuls.
The serving step's stacked cache [layers, Hkv, P, S, D] is handed over whole with the layer
index (read in the kernel), never sliced: a slice of the stacked cache is a copy of that
layer's whole pool per call, which on an H100 cost more than the rest of a decode step.
The reference for this kernel is :func:`jserve.kernels.reference.ragged_paged_attention`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jserve.kernels import blocks, kv_quant
from jserve.kernels.metadata import AttentionMetadata

PAGES_PER_BLOCK = 4
PREFILL_BLOCK_ROWS = 64
# Split-K aims for this many programs per launch (an H100 has 132 SMs; two programs per SM
# hide the gather latency) without splitting below one KV page per part.
TARGET_PROGRAMS = 256
MAX_SPLITS = 32


def _kernel(layer_ref, seq_lo_ref, seq_hi_ref, tok_pos_ref, q_end_ref, q_start_ref, kv_lens_ref,
            table_ref, q_ref, seq_ref, pos_ref, k_ref, v_ref, *refs, pages_per_block,
            blocks_per_split, tokens_per_block, scale, windowed):
    # k_ref, v_ref: the head's pages of every layer [L, P, S, D]; int8 pages bring their
    # scales (ks_ref, vs_ref [L, P, S, 1]) before the outputs. layer_ref: [layer] or, with
    # ``windowed``, [layer, window].
    ks_ref, vs_ref, o_ref, lse_ref = refs if len(refs) == 4 else (None, None, *refs)
    b, split = pl.program_id(1), pl.program_id(2)
    rows, d = q_ref.shape
    page_size = k_ref.shape[2]
    chunk = pages_per_block * page_size
    layer = layer_ref[0]
    q, row_seq, row_pos = q_ref[...], seq_ref[...], pos_ref[...]
    window = layer_ref[1] if windowed else None

    def load(ref, scale_ref, ids):
        """A KV page [chunk, D] in q's dtype, dequantized in registers."""
        x = ref[layer, ids].reshape(chunk, d)
        if scale_ref is not None:
            x = x.astype(jnp.float32) * scale_ref[layer, ids].reshape(chunk, 1)
        return x.astype(q.dtype)

    def per_seq(s, carry):
        kv_end = blocks.causal_end(b, s, tok_pos_ref, q_end_ref, kv_lens_ref[s],
                                   tokens_per_block)
        first_page = 0  # a window's loop starts at the block of its first page
        if windowed:
            first_page = blocks.window_first_page(b, s, tok_pos_ref, q_start_ref, window,
                                                  page_size, tokens_per_block)
        first = first_page // pages_per_block + split * blocks_per_split
        last = jnp.minimum(first + blocks_per_split, pl.cdiv(kv_end, chunk))

        def per_block(j, carry):
            ids = table_ref[s, pl.ds(j * pages_per_block, pages_per_block)]
            if windowed:  # entries before the window's first page are not addresses
                cols = j * pages_per_block + jnp.arange(pages_per_block)
                ids = jnp.where(cols >= first_page, ids, table_ref[s, first_page])
            k, v = load(k_ref, ks_ref, ids), load(v_ref, vs_ref, ids)
            kv_pos = j * chunk + jnp.arange(chunk)
            valid = (row_seq[:, None] == s) & (kv_pos[None, :] <= row_pos[:, None])
            if windowed:
                valid &= kv_pos[None, :] >= blocks.window_start(row_pos, window)[:, None]
            return blocks.attend_block(carry, q, k, v, valid, scale)

        return jax.lax.fori_loop(first, jnp.maximum(first, last), per_block, carry)

    carry = jax.lax.fori_loop(seq_lo_ref[b], seq_hi_ref[b], per_seq,
                              blocks.init_carry(rows, d))
    out, lse = blocks.finish(*carry)
    o_ref[...] = out
    lse_ref[...] = lse.reshape(rows)


def _attend(q: jax.Array, lay: blocks.RowLayout, k_pages, v_pages, layer, kv_lens, page_table,
            *, splits, pages_per_block, interpret, windowed):
    """One launch over q's row blocks [Hkv, NB, R, D] laid out by ``lay`` -> (out
    [Hkv, NB, R, D] f32, lse [Hkv, NB, R]); the pages are stacked [L, Hkv, P, S, D], read at
    ``layer`` [1] ([layer, window] when ``windowed``)."""
    hkv, nb, rows, d = q.shape
    num_layers, _, num_pages, page_size, _ = k_pages.shape
    (k_values, k_scales), (v_values, v_scales) = map(kv_quant.split, (k_pages, v_pages))
    width = page_table.shape[1]
    blocks_per_split = -(-(width // pages_per_block) // splits)
    kernel = functools.partial(_kernel, pages_per_block=pages_per_block,
                               blocks_per_split=blocks_per_split,
                               tokens_per_block=lay.tokens_per_block, scale=d ** -0.5,
                               windowed=windowed)
    whole = lambda x: pl.BlockSpec(x.shape, lambda h, b, k: (0,) * x.ndim)
    per_row = pl.BlockSpec((None, rows), lambda h, b, k: (b, 0))
    pages = pl.BlockSpec((num_layers, None, num_pages, page_size, d),
                         lambda h, b, k: (0, h, 0, 0, 0))
    # Without a window q_end stands in for q_start (unread), so nothing new is computed.
    scalars = (layer, lay.seq_lo, lay.seq_hi, lay.tok_pos, lay.q_end,
               lay.q_start if windowed else lay.q_end, kv_lens, page_table)
    kv, kv_specs = [k_values, v_values], [pages, pages]
    if k_scales is not None:
        kv += [k_scales, v_scales]
        kv_specs += [pl.BlockSpec((num_layers, None, num_pages, page_size, 1),
                                  lambda h, b, k: (0, h, 0, 0, 0))] * 2
    out, lse = pl.pallas_call(
        kernel,
        grid=(hkv, nb, splits),
        in_specs=[*map(whole, scalars),
                  pl.BlockSpec((None, None, rows, d), lambda h, b, k: (h, b, 0, 0)),
                  per_row, per_row, *kv_specs],
        out_specs=[pl.BlockSpec((None, None, None, rows, d), lambda h, b, k: (k, h, b, 0, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda h, b, k: (k, h, b, 0))],
        out_shape=[jax.ShapeDtypeStruct((splits, hkv, nb, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((splits, hkv, nb, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*scalars, q, lay.seq, lay.pos, *kv)
    return blocks.merge_partials(out, lse) if splits > 1 else (out[0], lse[0])


def _segments(meta: AttentionMetadata, group: int, prefill_block_rows: int):
    """(start, stop, tokens per block) of each launch: the decodes a token a block, the
    prefill chunks ``prefill_block_rows / G``."""
    nd, t = meta.num_decodes, meta.positions.shape[0]
    return [(lo, hi, bt) for lo, hi, bt in ((0, nd, 1),
                                           (nd, t, max(1, prefill_block_rows // group)))
            if hi > lo]


def row_layouts(meta: AttentionMetadata, group: int,
                prefill_block_rows: int = PREFILL_BLOCK_ROWS) -> tuple[blocks.RowLayout, ...]:
    """The layouts of this kernel's launches (``blocks.RowLayout``), for a step to make once
    before its layer loop (``meta.row_layouts``)."""
    num_live = meta.num_decodes + meta.num_prefills
    return tuple(blocks.row_layout(meta.positions, meta.token_seq, num_live,
                                   meta.page_table.shape[0], group, bt, lo, hi)
                 for lo, hi, bt in _segments(meta, group, prefill_block_rows))


def kv_splits(programs: int, kv_blocks: int) -> int:
    """Split-K factor for a launch of ``programs`` (KV head x query block) programs."""
    return max(1, min(-(-TARGET_PROGRAMS // max(1, programs)), kv_blocks, MAX_SPLITS))


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           meta: AttentionMetadata, *, interpret: bool = False,
                           pages_per_block: int = PAGES_PER_BLOCK,
                           prefill_block_rows: int = PREFILL_BLOCK_ROWS,
                           splits: int | None = None, layer=None, window=None
                           ) -> tuple[jax.Array, jax.Array]:
    """Same contract as the reference: (out [T, Hq, D] in q's dtype, lse [T, Hq] float32).
    Pages are one layer's [Hkv, P, S, D], or with ``layer`` (may be traced) a stacked cache
    [layers, Hkv, P, S, D] read at that layer in place. ``window``: the sliding window (as
    the reference's): each (sequence, query block) starts its KV loop, and its split-K parts,
    at the block of its first row's window, and never loads a page before that page.

    ``splits`` fixes the split-K factor of both launches (default: :func:`kv_splits`)."""
    (k_pages, v_pages), layer = blocks.stacked((k_pages, v_pages), layer)
    if window is not None:
        layer = jnp.concatenate([layer, jnp.asarray(window, jnp.int32).reshape(1)])
    t, hq, d = q.shape
    hkv = k_pages.shape[1]
    g = hq // hkv
    width = meta.page_table.shape[1]
    pages_per_block = min(pages_per_block, width)
    if width % pages_per_block:
        raise ValueError(f"page table width {width} is not a multiple of {pages_per_block}")
    run = functools.partial(_attend, k_pages=k_pages, v_pages=v_pages, layer=layer,
                            kv_lens=meta.kv_lens,
                            page_table=meta.page_table, pages_per_block=pages_per_block,
                            interpret=interpret, windowed=window is not None)
    layouts = meta.row_layouts
    outs, lses = [], []
    for lo, hi, bt in _segments(meta, g, prefill_block_rows):
        lay = blocks.find_layout(layouts, lo, hi, g, bt)
        if lay is None:  # the step made none for this blocking: made here
            layouts = row_layouts(meta, g, prefill_block_rows)
            lay = blocks.find_layout(layouts, lo, hi, g, bt)
        qb = blocks.block_rows(q[lo:hi], lay)
        n = splits or kv_splits(hkv * qb.shape[1], width // pages_per_block)
        out, lse = run(qb, lay, splits=n)
        outs.append(blocks.unblock(out, hi - lo, g, bt))
        lses.append(blocks.unblock(lse, hi - lo, g, bt))
    return jnp.concatenate(outs).astype(q.dtype), jnp.concatenate(lses)

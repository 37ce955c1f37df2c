"""Pure-jnp ragged paged attention: the reference every kernel is tested against.

The batch is token-flattened: the first ``num_decodes`` tokens are single-token decodes (token
i belongs to sequence i), the remaining tokens are prefill chunks of the sequences after them.
Each sequence attends causally to all of its KV in the paged cache (the new tokens' KV is
already written). KV is visited in blocks of pages with an online softmax, so memory stays
bounded at any context length and the loop runs only as far as the longest live context.
Returns the attention output and the log-sum-exp of the scaled scores (what split-K and
KV-cache-parallel merges combine on).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jserve.kernels import kv_quant
from jserve.kernels.blocks import window_start
from jserve.kernels.metadata import AttentionMetadata

_MASKED = -1e30
# KV pages visited per online-softmax step. Small blocks waste less on short contexts; on a
# 2-core CPU 4 pages of 16 tokens beat 1, 2, 8 and 16 at both 160- and 1000-token contexts
# (decode, batch 32, 2 KV heads).
PAGES_PER_BLOCK = 4
# Query rows of one prefill sequence attended together (a tile reads each KV page once).
_PREFILL_TILE = 64


def _online_update(m, l, acc, s, v, valid):
    """One online-softmax step. s: [..., C] scores, v: values contracted on C, valid: mask."""
    s = jnp.where(valid, s, _MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None] + v(p)


def _finish(m, l, acc):
    safe_l = jnp.where(l > 0, l, 1.0)
    out = acc / safe_l[..., None]
    lse = jnp.where(l > 0, m + jnp.log(safe_l), -jnp.inf)
    return out, lse


def _gather(pages, page_ids, layer=None):
    if layer is None:
        g = pages[:, page_ids]
    else:  # mixed scalar/array indices around a slice put the indexed dims first
        g = jnp.moveaxis(pages[layer, :, page_ids], -3, 0)
    return g.reshape(*g.shape[:-3], g.shape[-3] * g.shape[-2], g.shape[-1])


def _gather_block(pages, page_ids, layer=None):
    """pages [Hkv, P, S, D], page_ids [..., n] -> float32 [Hkv, ..., n*S, D]. With ``layer``,
    pages are stacked [layers, Hkv, P, S, D] and read at that layer by the same single gather
    (no copy of the layer's pages). Quantized pages (``jserve.kernels.kv_quant``) are
    dequantized block by block as they are read."""
    values, scales = kv_quant.split(pages)
    return kv_quant.dequantize(_gather(values, page_ids, layer),
                               None if scales is None else _gather(scales, page_ids, layer))


def _decode_attention(q, k_pages, v_pages, kv_lens, page_table, pages_per_block, scale,
                      layer=None, kv_starts=None):
    """q [Hkv, B, G, D]; one query per sequence at position kv_len - 1.

    The live (sequence, KV page) pairs are flattened and visited B at a time, so a step
    costs the batch's total context, not B x its longest: one long decode does not make every
    row in the batch pay for its context. Each visit's partial softmax is merged into
    its row by scatter max/add (split-K with a log-sum-exp merge).

    ``kv_starts`` [B] (sliding windows; None: 0): the first key position each row reads. A
    row's blocks start at the block holding it, and page-table entries before its page are
    never used as addresses (the block's first in-window page is read in their place, and
    masked): the pages before a window may be freed or garbage."""
    hkv, b, g, d = q.shape
    page_size = k_pages.shape[-2]
    block = pages_per_block * page_size
    qf = q.astype(jnp.float32) * scale
    first_page = None if kv_starts is None else kv_starts // page_size    # [B]
    skip = 0 if kv_starts is None else first_page // pages_per_block     # [B] blocks before
    n_blocks = (kv_lens + block - 1) // block - skip                      # [B]
    if kv_starts is not None:  # a row whose window ends before its keys here reads nothing
        n_blocks = jnp.where(kv_starts < kv_lens, n_blocks, 0)
    ends = jnp.cumsum(n_blocks)
    starts = ends - n_blocks
    live_pairs = ends[-1]

    def body(step, carry):
        m, l, acc = carry
        item = step * b + jnp.arange(b)                     # b (row, block) pairs per step
        row = jnp.minimum(jnp.sum(ends[None, :] <= item[:, None], axis=1), b - 1)
        blk = item - starts[row] + (0 if kv_starts is None else skip[row])
        cols = blk[:, None] * pages_per_block + jnp.arange(pages_per_block)[None, :]
        if kv_starts is not None:
            cols = jnp.maximum(cols, first_page[row][:, None])
        ids = jnp.take_along_axis(page_table[row], jnp.clip(cols, 0, page_table.shape[1] - 1),
                                  axis=1)
        k = _gather_block(k_pages, ids, layer)  # [Hkv, b, C, D]
        v = _gather_block(v_pages, ids, layer)
        s = jnp.einsum("hbgd,hbcd->hbgc", qf[:, row], k)
        pos = blk[:, None] * block + jnp.arange(block)[None, :]
        valid = (item < live_pairs)[:, None] & (pos < kv_lens[row][:, None])
        if kv_starts is not None:
            valid &= pos >= kv_starts[row][:, None]
        valid = valid[None, :, None, :]
        s = jnp.where(valid, s, _MASKED)
        m_i = s.max(axis=-1)                                 # [Hkv, b, G]
        p = jnp.where(valid, jnp.exp(s - m_i[..., None]), 0.0)
        m_new = m.at[:, row].max(m_i)
        beta = jnp.exp(m_i - m_new[:, row])
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.zeros_like(l).at[:, row].add(p.sum(axis=-1) * beta)
        pv = jnp.einsum("hbgc,hbcd->hbgd", p, v) * beta[..., None]
        acc = acc * alpha[..., None] + jnp.zeros_like(acc).at[:, row].add(pv)
        return m_new, l, acc

    init = (jnp.full((hkv, b, g), _MASKED, jnp.float32), jnp.zeros((hkv, b, g), jnp.float32),
            jnp.zeros((hkv, b, g, d), jnp.float32))
    return _finish(*jax.lax.fori_loop(0, (live_pairs + b - 1) // b, body, init))


def _prefill_attention(q, q_seq, q_pos, k_pages, v_pages, kv_lens, page_table, num_seqs,
                       pages_per_block, scale, rows_per_tile=_PREFILL_TILE, layer=None,
                       window=None):
    """q [Hkv, T, G, D] of several sequences' chunks; q_seq/q_pos give each token's owner and
    absolute position (a sequence's tokens are contiguous). Loops over live sequences, then
    over tiles of their own query rows, then over the KV pages the tile can see, so a long
    sequence's context is read against its own chunk only, not every prefill row. With a
    ``window``, a tile's loop starts at the block holding its first row's first key, and
    entries before that key's page are not used as addresses (as in the decode)."""
    hkv, t, g, d = q.shape
    page_size = k_pages.shape[-2]
    block = pages_per_block * page_size
    r = min(rows_per_tile, t)
    qf = q.astype(jnp.float32) * scale

    def per_seq(i, carry):
        first = jnp.sum(q_seq < i)
        n_rows = jnp.sum(q_seq == i)

        def per_tile(tile, carry):
            # Clamped to stay inside T; rows of other sequences in the tile, and rows an
            # earlier tile finished (a clamped tile overlaps it), are masked and come out of
            # the online update unchanged (seen twice, a row's l would double: its LSE, which
            # KV-parallel merges weigh by, off by log 2).
            start = first + tile * r
            at = jnp.minimum(start, t - r)
            sl = lambda x: jax.lax.dynamic_slice_in_dim(x, at, r, axis=1)
            rows = ((jax.lax.dynamic_slice_in_dim(q_seq, at, r) == i)
                    & (at + jnp.arange(r) >= start))
            pos_q = jax.lax.dynamic_slice_in_dim(q_pos, at, r)
            qt = sl(qf).reshape(hkv, r * g, d)
            seen = jnp.minimum(kv_lens[i], jnp.max(jnp.where(rows, pos_q, -1)) + 1)
            lo_q = 0 if window is None else window_start(pos_q, window)   # [r]
            first_page = 0 if window is None else (
                jnp.min(jnp.where(rows, lo_q, seen)) // page_size)

            def per_block(j, tile_carry):
                if window is None:
                    ids = jax.lax.dynamic_slice_in_dim(page_table[i], j * pages_per_block,
                                                       pages_per_block)
                else:
                    cols = j * pages_per_block + jnp.arange(pages_per_block)
                    ids = page_table[i, jnp.maximum(cols, first_page)]
                k = _gather_block(k_pages, ids, layer)  # [Hkv, C, D]
                v = _gather_block(v_pages, ids, layer)
                s = jnp.einsum("hqd,hcd->hqc", qt, k).reshape(hkv, r, g, block)
                pos = j * block + jnp.arange(block)
                valid = rows[:, None] & (pos[None, :] <= pos_q[:, None]) & (pos[None, :] < seen)
                if window is not None:
                    valid &= pos[None, :] >= lo_q[:, None]
                return _online_update(
                    *tile_carry, s,
                    lambda p: jnp.einsum("hqc,hcd->hqd", p.reshape(hkv, r * g, block),
                                         v).reshape(hkv, r, g, d),
                    valid[None, :, None, :])

            out = jax.lax.fori_loop(first_page // pages_per_block, (seen + block - 1) // block,
                                    per_block, tuple(map(sl, carry)))
            return tuple(jax.lax.dynamic_update_slice_in_dim(c, o, at, axis=1)
                         for c, o in zip(carry, out))

        return jax.lax.fori_loop(0, (n_rows + r - 1) // r, per_tile, carry)

    init = (jnp.full((hkv, t, g), _MASKED, jnp.float32), jnp.zeros((hkv, t, g), jnp.float32),
            jnp.zeros((hkv, t, g, d), jnp.float32))
    return _finish(*jax.lax.fori_loop(0, num_seqs, per_seq, init))


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           meta: AttentionMetadata, *, pages_per_block: int = PAGES_PER_BLOCK,
                           rows_per_tile: int = _PREFILL_TILE, layer=None, decode=None,
                           prefill=None, window=None) -> tuple[jax.Array, jax.Array]:
    """Attention of a mixed batch of decodes and prefill chunks over a paged KV cache.

    q: [T, Hq, D]; k_pages, v_pages: [Hkv, num_pages, page_size, D] (already holding this
    step's KV), or stacked [layers, Hkv, ...] read at ``layer``. Returns (out [T, Hq, D] in q's
    dtype, lse [T, Hq] float32; -inf where a token has no keys, e.g. padding). ``decode``:
    what attends the decode rows, with ``_decode_attention``'s contract (the native CPU kernel,
    ``jserve.kernels.cpu``); default ``_decode_attention``; ``prefill`` the same for the
    prefill chunks (``_prefill_attention``'s contract). ``window``: the layer's sliding
    window (an int32 scalar, may be traced; 0: full attention), a query at position p reading
    keys at p - window < k <= p; pages wholly before every query's window are not read (None:
    no window code at all).
    """
    t, hq, d = q.shape
    hkv = k_pages.shape[-4]
    g = hq // hkv
    nd = meta.num_decodes
    scale = d ** -0.5
    width = meta.page_table.shape[1]
    pages_per_block = min(pages_per_block, width)
    if width % pages_per_block:
        raise ValueError(f"page table width {width} is not a multiple of {pages_per_block}")
    qg = q.reshape(t, hkv, g, d).transpose(1, 0, 2, 3)  # [Hkv, T, G, D]
    outs, lses = [], []
    if nd:
        starts = None if window is None else window_start(meta.positions[:nd], window)
        o, l = (decode or _decode_attention)(qg[:, :nd], k_pages, v_pages, meta.kv_lens[:nd],
                                             meta.page_table[:nd], pages_per_block, scale,
                                             layer, starts)
        outs.append(o)
        lses.append(l)
    if t > nd:
        o, l = (prefill or _prefill_attention)(qg[:, nd:], meta.token_seq[nd:] - nd,
                                               meta.positions[nd:],
                                  k_pages, v_pages, meta.kv_lens[nd:], meta.page_table[nd:],
                                  meta.num_prefills, pages_per_block, scale,
                                  rows_per_tile, layer, window)
        outs.append(o)
        lses.append(l)
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]  # [Hkv, T, G, D]
    lse = jnp.concatenate(lses, axis=1) if len(lses) > 1 else lses[0]
    out = out.transpose(1, 0, 2, 3).reshape(t, hq, d).astype(q.dtype)
    return out, lse.transpose(1, 0, 2).reshape(t, hq)


def dense_reference(q, k, v, q_pos, kv_len, window=0):
    """Plain causal attention of one sequence without pages, for testing the paged path.

    q [Tq, Hq, D] at positions q_pos, k/v [kv_len, Hkv, D]; ``window`` > 0: a sliding window
    (keys at q_pos - window < k)."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    g = hq // hkv
    kk = jnp.repeat(k, g, axis=1).astype(jnp.float32)
    vv = jnp.repeat(v, g, axis=1).astype(jnp.float32)
    s = jnp.einsum("thd,chd->thc", q.astype(jnp.float32), kk) * d ** -0.5
    mask = jnp.arange(kv_len)[None, :] <= q_pos[:, None]
    if window:
        mask &= jnp.arange(kv_len)[None, :] > q_pos[:, None] - window
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("thc,chd->thd", jnp.exp(s - lse[..., None]), vv), lse

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

from jserve.kernels.metadata import AttentionMetadata

_MASKED = -1e30
# KV pages visited per online-softmax step. Small blocks waste less on short contexts; on a
# 2-core CPU 4 pages of 16 tokens beat 1, 2, 8 and 16 at both 160- and 1000-token contexts
# (decode, batch 32, 2 KV heads).
PAGES_PER_BLOCK = 4


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


def _gather_block(pages, page_ids):
    """pages [Hkv, P, S, D], page_ids [..., n] -> [Hkv, ..., n*S, D]."""
    g = pages[:, page_ids]
    return g.reshape(*g.shape[:-3], g.shape[-3] * g.shape[-2], g.shape[-1])


def _decode_attention(q, k_pages, v_pages, kv_lens, page_table, pages_per_block, scale):
    """q [Hkv, B, G, D]; one query per sequence at position kv_len - 1.

    Head-major everywhere so both products are plain batched matmuls over (head, sequence).
    """
    hkv, b, g, d = q.shape
    page_size = k_pages.shape[2]
    block = pages_per_block * page_size
    qf = q.astype(jnp.float32) * scale
    n_blocks = (kv_lens.max() + block - 1) // block

    def body(j, carry):
        ids = jax.lax.dynamic_slice_in_dim(page_table, j * pages_per_block, pages_per_block, axis=1)
        k = _gather_block(k_pages, ids).astype(jnp.float32)  # [Hkv, B, C, D]
        v = _gather_block(v_pages, ids).astype(jnp.float32)
        s = jnp.einsum("hbgd,hbcd->hbgc", qf, k)
        pos = j * block + jnp.arange(block)
        valid = (pos[None, :] < kv_lens[:, None])[None, :, None, :]
        return _online_update(*carry, s, lambda p: jnp.einsum("hbgc,hbcd->hbgd", p, v), valid)

    init = (jnp.full((hkv, b, g), _MASKED, jnp.float32), jnp.zeros((hkv, b, g), jnp.float32),
            jnp.zeros((hkv, b, g, d), jnp.float32))
    return _finish(*jax.lax.fori_loop(0, n_blocks, body, init))


def _prefill_attention(q, q_seq, q_pos, k_pages, v_pages, kv_lens, page_table, num_seqs,
                       pages_per_block, scale):
    """q [Hkv, T, G, D] of several sequences' chunks; q_seq/q_pos give each token's owner and
    absolute position. Loops over live sequences, then over their KV blocks."""
    hkv, t, g, d = q.shape
    page_size = k_pages.shape[2]
    block = pages_per_block * page_size
    qf = (q.astype(jnp.float32) * scale).reshape(hkv, t * g, d)

    def per_seq(i, carry):
        rows = q_seq == i

        def per_block(j, carry):
            ids = jax.lax.dynamic_slice_in_dim(page_table[i], j * pages_per_block, pages_per_block)
            k = _gather_block(k_pages, ids).astype(jnp.float32)  # [Hkv, C, D]
            v = _gather_block(v_pages, ids).astype(jnp.float32)
            s = jnp.einsum("hqd,hcd->hqc", qf, k).reshape(hkv, t, g, block)
            pos = j * block + jnp.arange(block)
            valid = rows[:, None] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < kv_lens[i])
            return _online_update(
                *carry, s,
                lambda p: jnp.einsum("hqc,hcd->hqd", p.reshape(hkv, t * g, block), v).reshape(
                    hkv, t, g, d),
                valid[None, :, None, :])

        n_blocks = (kv_lens[i] + block - 1) // block
        return jax.lax.fori_loop(0, n_blocks, per_block, carry)

    init = (jnp.full((hkv, t, g), _MASKED, jnp.float32), jnp.zeros((hkv, t, g), jnp.float32),
            jnp.zeros((hkv, t, g, d), jnp.float32))
    return _finish(*jax.lax.fori_loop(0, num_seqs, per_seq, init))


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           meta: AttentionMetadata, *, pages_per_block: int = PAGES_PER_BLOCK
                           ) -> tuple[jax.Array, jax.Array]:
    """Attention of a mixed batch of decodes and prefill chunks over a paged KV cache.

    q: [T, Hq, D]; k_pages, v_pages: [Hkv, num_pages, page_size, D] (already holding this
    step's KV). Returns (out [T, Hq, D] in q's dtype, lse [T, Hq] float32; -inf where a token
    has no keys, e.g. padding).
    """
    t, hq, d = q.shape
    hkv = k_pages.shape[0]
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
        o, l = _decode_attention(qg[:, :nd], k_pages, v_pages, meta.kv_lens[:nd],
                                 meta.page_table[:nd], pages_per_block, scale)
        outs.append(o)
        lses.append(l)
    if t > nd:
        o, l = _prefill_attention(qg[:, nd:], meta.token_seq[nd:] - nd, meta.positions[nd:],
                                  k_pages, v_pages, meta.kv_lens[nd:], meta.page_table[nd:],
                                  meta.num_prefills, pages_per_block, scale)
        outs.append(o)
        lses.append(l)
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]  # [Hkv, T, G, D]
    lse = jnp.concatenate(lses, axis=1) if len(lses) > 1 else lses[0]
    out = out.transpose(1, 0, 2, 3).reshape(t, hq, d).astype(q.dtype)
    return out, lse.transpose(1, 0, 2).reshape(t, hq)


def dense_reference(q, k, v, q_pos, kv_len):
    """Plain causal attention of one sequence without pages, for testing the paged path.

    q [Tq, Hq, D] at positions q_pos, k/v [kv_len, Hkv, D]."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    g = hq // hkv
    kk = jnp.repeat(k, g, axis=1).astype(jnp.float32)
    vv = jnp.repeat(v, g, axis=1).astype(jnp.float32)
    s = jnp.einsum("thd,chd->thc", q.astype(jnp.float32), kk) * d ** -0.5
    mask = jnp.arange(kv_len)[None, :] <= q_pos[:, None]
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("thc,chd->thd", jnp.exp(s - lse[..., None]), vv), lse

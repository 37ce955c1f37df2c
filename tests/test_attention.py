"""The paged ragged reference attention against plain causal attention per sequence."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.kernels import AttentionMetadata, attention
from jserve.kernels.reference import dense_reference


def _ragged_case(rng, decode_ctx, prefill, hq, hkv, d, page_size=4, width=16, pad_seqs=1):
    """decode_ctx: context lengths of decode rows; prefill: (already cached, chunk) pairs."""
    seqs = [(c - 1, 1) for c in decode_ctx] + list(prefill)
    num_pages = 1 + sum(-(-(a + b) // page_size) for a, b in seqs)
    k_pages = np.zeros((hkv, num_pages, page_size, d), np.float32)
    v_pages = np.zeros_like(k_pages)
    free = list(rng.permutation(np.arange(1, num_pages)))  # scattered pages
    s = len(seqs) + pad_seqs
    table = np.zeros((s, width), np.int32)
    kv_lens = np.zeros(s, np.int32)
    q_parts, pos_parts, seq_parts, dense = [], [], [], []
    for i, (cached, chunk) in enumerate(seqs):
        total = cached + chunk
        pages = [free.pop() for _ in range(-(-total // page_size))]
        table[i, :len(pages)] = pages
        kv_lens[i] = total
        k = rng.normal(size=(total, hkv, d)).astype(np.float32)
        v = rng.normal(size=(total, hkv, d)).astype(np.float32)
        for p in range(total):
            k_pages[:, pages[p // page_size], p % page_size] = k[p]
            v_pages[:, pages[p // page_size], p % page_size] = v[p]
        q = rng.normal(size=(chunk, hq, d)).astype(np.float32)
        pos = np.arange(cached, total, dtype=np.int32)
        q_parts.append(q)
        pos_parts.append(pos)
        seq_parts.append(np.full(chunk, i, np.int32))
        dense.append((q, k, v, pos))
    q = np.concatenate(q_parts)
    pad = 3  # padding tokens at the end own no sequence
    q = np.concatenate([q, np.zeros((pad, hq, d), np.float32)])
    positions = np.concatenate(pos_parts + [np.zeros(pad, np.int32)])
    token_seq = np.concatenate(seq_parts + [np.full(pad, s, np.int32)])
    meta = AttentionMetadata(positions=jnp.asarray(positions), token_seq=jnp.asarray(token_seq),
                             kv_lens=jnp.asarray(kv_lens), page_table=jnp.asarray(table),
                             num_prefills=jnp.asarray(len(prefill), jnp.int32),
                             num_decodes=len(decode_ctx))
    return q, k_pages, v_pages, meta, dense


@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 16), (8, 2, 32), (8, 1, 16)])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_mixed_ragged_batch_matches_dense_causal_attention(hq, hkv, d, dtype, tol):
    rng = np.random.default_rng(hq * 100 + hkv * 10 + d)
    q, kp, vp, meta, dense = _ragged_case(
        rng, decode_ctx=[1, 4, 5, 37], prefill=[(0, 9), (6, 1), (13, 20)], hq=hq, hkv=hkv, d=d)
    out, lse = attention(jnp.asarray(q, dtype), jnp.asarray(kp, dtype), jnp.asarray(vp, dtype),
                         meta)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    row = 0
    for qi, k, v, pos in dense:
        cast = lambda x: jnp.asarray(x, dtype)
        ref_out, ref_lse = dense_reference(cast(qi), cast(k), cast(v), jnp.asarray(pos), len(k))
        n = len(qi)
        np.testing.assert_allclose(out[row:row + n], np.asarray(ref_out), atol=tol, rtol=tol)
        np.testing.assert_allclose(lse[row:row + n], np.asarray(ref_lse), atol=tol, rtol=tol)
        row += n
    assert np.all(out[row:] == 0) and np.all(np.isneginf(lse[row:]))


def test_long_context_spanning_many_kv_blocks():
    rng = np.random.default_rng(0)
    q, kp, vp, meta, dense = _ragged_case(rng, decode_ctx=[700, 3], prefill=[(500, 37)], hq=4,
                                          hkv=2, d=16, page_size=8, width=128)
    out, lse = attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), meta)
    row = 0
    for qi, k, v, pos in dense:
        ref_out, ref_lse = dense_reference(jnp.asarray(qi), jnp.asarray(k), jnp.asarray(v),
                                           jnp.asarray(pos), len(k))
        np.testing.assert_allclose(np.asarray(out)[row:row + len(qi)], ref_out, atol=3e-5)
        np.testing.assert_allclose(np.asarray(lse)[row:row + len(qi)], ref_lse, atol=3e-5)
        row += len(qi)

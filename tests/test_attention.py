"""The paged ragged reference attention against plain causal attention per sequence."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.kernels import attention
from jserve.kernels.reference import dense_reference, ragged_paged_attention
from ragged import ragged_case


@pytest.mark.slow
@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 16), (8, 2, 32), (8, 1, 16)])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_mixed_ragged_batch_matches_dense_causal_attention(hq, hkv, d, dtype, tol):
    rng = np.random.default_rng(hq * 100 + hkv * 10 + d)
    q, kp, vp, meta, dense = ragged_case(
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


@pytest.mark.slow
@pytest.mark.parametrize("decode_ctx, prefill, rows_per_tile", [
    ([700, 3], [(500, 37)], 64),
    # One long decode among short ones (live blocks visited, not B x the longest), and
    # prefill chunks spanning several query tiles, the last tile clamped into the previous
    # sequence's rows.
    ([3, 650, 1, 17], [(0, 23), (5, 2), (300, 30)], 8)])
def test_long_context_spanning_many_kv_blocks(decode_ctx, prefill, rows_per_tile):
    rng = np.random.default_rng(0)
    q, kp, vp, meta, dense = ragged_case(rng, decode_ctx=decode_ctx, prefill=prefill, hq=4,
                                          hkv=2, d=16, page_size=8, width=128)
    out, lse = ragged_paged_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), meta,
                                      rows_per_tile=rows_per_tile)
    row = 0
    for qi, k, v, pos in dense:
        ref_out, ref_lse = dense_reference(jnp.asarray(qi), jnp.asarray(k), jnp.asarray(v),
                                           jnp.asarray(pos), len(k))
        np.testing.assert_allclose(np.asarray(out)[row:row + len(qi)], ref_out, atol=3e-5)
        np.testing.assert_allclose(np.asarray(lse)[row:row + len(qi)], ref_lse, atol=3e-5)
        row += len(qi)

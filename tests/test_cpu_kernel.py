"""The native CPU kernels (``attention_impl="cpu"``, jserve/kernels/cpu.py): compiled on
first use, called through the XLA FFI; their decode rows and prefill chunks against the jnp
reference on random ragged batches (GQA groups, head dims, float32, bfloat16 and int8 pages,
contexts past a thousand tokens, sliding windows, padding rows), a traced layer of a stacked
cache read in place, fp8 pages left to the reference, and ``auto`` choosing them on CPU only
where they build; the reference's own LSE against dense attention."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.kernels import cpu, kv_quant, resolve_impl
from jserve.kernels.reference import dense_reference, ragged_paged_attention as reference
from ragged import ragged_case

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
TARGET = "jserve_cpu_decode_attention"
PREFILL = "jserve_cpu_prefill_attention"


def native_calls(fn, *args, target=TARGET) -> int:
    """How many times the compiled ``fn`` calls the native kernel ``target``."""
    return jax.jit(fn).lower(*args).as_text().count(target)


@pytest.mark.parametrize("hq, hkv, d, dtype, max_ctx", [
    (4, 4, 64, jnp.float32, 60), (8, 2, 128, jnp.bfloat16, 60), (16, 1, 64, jnp.float32, 60),
    (8, 2, 64, jnp.float32, 1500)])
def test_native_decode_matches_the_reference(hq, hkv, d, dtype, max_ctx):
    rng = np.random.default_rng(hq * 100 + d + max_ctx)
    decode_ctx = [int(c) for c in rng.integers(1, max_ctx, 5)] + [0, 1]
    prefill = [(0, 9), (int(rng.integers(1, 30)), 6)]
    width = (-(-max_ctx // 4) + 4 + 3) // 4 * 4  # pages; a multiple of the reference's block
    q, kp, vp, meta, _ = ragged_case(rng, decode_ctx, prefill, hq=hq, hkv=hkv, d=d,
                                     page_size=4, width=width)
    q, kp, vp = (jnp.asarray(x, dtype) for x in (q, kp, vp))
    attend = lambda q, k, v, meta: cpu.ragged_paged_attention(q, k, v, meta)  # noqa: E731
    assert native_calls(attend, q, kp, vp, meta) == 1
    out, lse = jax.jit(attend)(q, kp, vp, meta)
    ref_out, ref_lse = reference(q, kp, vp, meta)
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=tol, rtol=tol)
    empty = np.isneginf(np.asarray(ref_lse))  # the padding decode row: 0 and -inf exactly
    assert empty.any() and np.all(np.isneginf(np.asarray(lse))[empty])
    assert np.all(np.asarray(out, np.float32)[empty] == 0)


@pytest.mark.parametrize("decode_ctx, prefill, target", [
    ([9, 30, 0], [], TARGET), ([], [(20, 30)], PREFILL)])
def test_native_kernels_read_a_traced_layer_of_a_stacked_cache(decode_ctx, prefill, target):
    rng = np.random.default_rng(3)
    q, kp, vp, meta, _ = ragged_case(rng, decode_ctx, prefill, hq=8, hkv=2, d=64,
                                     page_size=4, width=16)
    noise = lambda: rng.normal(size=(3, *kp.shape))  # noqa: E731
    k_stack = jnp.asarray(noise(), jnp.float32).at[1].set(kp)
    v_stack = jnp.asarray(noise(), jnp.float32).at[1].set(vp)
    at_layer = lambda q, k, v, meta, i: cpu.ragged_paged_attention(q, k, v, meta, layer=i)  # noqa: E731
    args = (jnp.asarray(q), k_stack, v_stack, meta, jnp.int32(1))
    assert native_calls(at_layer, *args, target=target) == 1
    out, lse = jax.jit(at_layer)(*args)
    ref_out, ref_lse = reference(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), meta)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=2e-5)


def _pages(kp, vp, kind):
    """The case's pages stored as ``kind`` (int8: a QuantizedPages of values and scales)."""
    if kind != "int8":
        return jnp.asarray(kp, kind), jnp.asarray(vp, kind)
    return tuple(kv_quant.QuantizedPages(*kv_quant.quantize(jnp.asarray(x), jnp.int8))
                 for x in (kp, vp))


@pytest.mark.parametrize("hq, hkv, d, kind, page_size, prefill, decode_ctx, window", [
    # a context past a thousand tokens, chunks longer than a tile, a one-token chunk
    (12, 4, 64, "float32", 16, [(0, 70), (1200, 90), (5, 1)], [40, 0], None),
    (8, 2, 128, "bfloat16", 4, [(0, 9), (17, 33)], [], None),
    (16, 1, 64, "int8", 4, [(3, 40), (60, 24)], [7], None),
    (4, 4, 64, "float32", 8, [(50, 60), (0, 13)], [20], 24),   # a sliding window
    (32, 2, 32, "float32", 4, [(9, 30)], [], None),            # a group past the tile's rows
])
def test_native_prefill_matches_the_reference(hq, hkv, d, kind, page_size, prefill,
                                              decode_ctx, window):
    rng = np.random.default_rng(hq + d + page_size)
    longest = max(a + b for a, b in prefill)
    width = (-(-longest // page_size) + 3) // 4 * 4
    q, kp, vp, meta, _ = ragged_case(rng, decode_ctx, prefill, hq=hq, hkv=hkv, d=d,
                                     page_size=page_size, width=width)
    q, (kp, vp) = jnp.asarray(q), _pages(kp, vp, kind)
    w = None if window is None else jnp.int32(window)
    attend = lambda q, k, v, meta: cpu.ragged_paged_attention(q, k, v, meta, window=w)  # noqa: E731
    assert native_calls(attend, q, kp, vp, meta, target=PREFILL) == 1
    out, lse = jax.jit(attend)(q, kp, vp, meta)
    ref_out, ref_lse = jax.jit(
        lambda q, k, v, m: reference(q, k, v, m, window=w))(q, kp, vp, meta)
    tol = TOL[jnp.bfloat16 if kind == "bfloat16" else jnp.float32]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=tol, rtol=tol)
    empty = np.isneginf(np.asarray(ref_lse))  # padding tokens: 0 and -inf exactly
    assert empty.any() and np.array_equal(np.isneginf(np.asarray(lse)), empty)
    assert np.all(np.asarray(out)[empty] == 0)


def test_reference_prefill_lse_counts_each_row_once_when_its_last_tile_is_clamped():
    """A chunk of 100 tokens ends the batch: its second 64-row tile is clamped back to the
    batch's end and overlaps the first. Each row's LSE is dense attention's (it came out
    log 2 too large on the overlapped rows, which KV-parallel merges would misweigh)."""
    rng = np.random.default_rng(6)
    q, kp, vp, meta, dense = ragged_case(rng, [], [(10, 100)], hq=4, hkv=2, d=64,
                                         page_size=4, width=32, pad_seqs=0)
    t = 100  # the case's 3 padding tokens follow; a tile ends at t + 3
    out, lse = reference(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), meta)
    dq, dk, dv, pos = dense[0]
    d_out, d_lse = dense_reference(jnp.asarray(dq), jnp.asarray(dk), jnp.asarray(dv),
                                   jnp.asarray(pos), len(dk))
    np.testing.assert_allclose(lse[:t], d_lse, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(out[:t], d_out, atol=2e-5, rtol=2e-5)


def test_fp8_pages_stay_on_the_reference():
    rng = np.random.default_rng(5)
    q, kp, vp, meta, _ = ragged_case(rng, [9, 30], [(3, 9)], hq=4, hkv=2, d=64, page_size=4,
                                     width=16)
    q = jnp.asarray(q)
    kp, vp = (jnp.asarray(x, jnp.float8_e4m3fn) for x in (kp, vp))
    attend = lambda q, k, v, meta: cpu.ragged_paged_attention(q, k, v, meta)  # noqa: E731
    assert native_calls(attend, q, kp, vp, meta) == 0
    assert native_calls(attend, q, kp, vp, meta, target=PREFILL) == 0
    out, lse = jax.jit(attend)(q, kp, vp, meta)
    ref_out, ref_lse = jax.jit(reference)(q, kp, vp, meta)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(lse, ref_lse)


def test_auto_is_the_native_kernel_on_cpu_where_it_builds(monkeypatch):
    assert cpu.available()  # a C++ compiler is part of this project's machines
    assert resolve_impl("auto", "cpu") == "cpu"
    monkeypatch.setattr(cpu, "_state", {"ok": False, "error": "no compiler"})
    assert resolve_impl("auto", "cpu") == "reference"
    assert resolve_impl("auto", "gpu") == "pallas_gpu"

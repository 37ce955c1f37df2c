"""Quantized KV pages (``jserve.kernels.kv_quant``): the stored formats' rounding, attention
over int8 and fp8 pages against full precision within a bound derived from the format, for
decode, chunked-prefill and mixed ragged batches, with the reference and both Pallas kernels
(interpreted), the quantized cache write, and the kernels' lowering with quantized pages."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.config import KV_CACHE_DTYPES
from jserve.kernels import kv_quant, kv_write, pallas_gpu, pallas_tpu, write_kv
from jserve.kernels.reference import ragged_paged_attention as reference
from ragged import interpreted_flavours, lowering_case, ragged_case

QUANTIZED = [k for k in KV_CACHE_DTYPES if k != "auto"]
KERNELS = {
    "reference": reference,
    **interpreted_flavours(),
}
# Smallest normal of each fp8 format: below it the rounding step is fixed (subnormals).
_FP8_MIN_NORMAL = {"fp8_e4m3": 2.0 ** -6, "fp8_e5m2": 2.0 ** -14}
# The stated error bounds of attention over quantized pages against full precision, for
# unit-normal q, k, v (head_dim 64, contexts up to 60): (max |out error|, mean |out error|,
# max |lse error|). Measured on these batches: int8 0.020 / 0.0026 / 0.016, e4m3 0.12 / 0.011
# / 0.047, e5m2 0.23 / 0.021 / 0.12 (docs/quantization.md). The worst-case bound
# (attention_error_bound) holds too, but for fp8 it is loose: rounding errors of a float
# format are relative and mostly cancel in the softmax-weighted sums.
ERROR_BOUNDS = {"int8": (0.05, 5e-3, 0.05), "fp8_e4m3": (0.25, 2.5e-2, 0.15),
                "fp8_e5m2": (0.5, 5e-2, 0.3)}


def quantized_pages(x: np.ndarray, kind: str):
    values, scales = kv_quant.quantize(jnp.asarray(x), kv_quant.storage_dtype(kind, jnp.float32))
    return values if scales is None else kv_quant.QuantizedPages(values, scales)


def element_error_bound(x: np.ndarray, kind: str) -> np.ndarray:
    """Worst rounding error of each element of x [..., D] stored as ``kind``: half a step of
    the row's int8 grid, or half an fp8 ulp (relative inside the normal range, fixed below)."""
    rel = kv_quant.relative_error_bound(kind)
    if kind == "int8":
        return np.abs(x).max(axis=-1, keepdims=True) * rel * np.ones_like(x) * (1 + 1e-6)
    return np.maximum(np.abs(x), _FP8_MIN_NORMAL[kind]) * rel


@pytest.mark.parametrize("kind", QUANTIZED)
def test_stored_rows_round_within_the_formats_bound_and_saturate(kind):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4, 32)).astype(np.float32) * rng.uniform(1e-3, 30, (64, 4, 1))
    x[0, 0] = 0.0  # an all-zero row keeps a usable scale
    pages = quantized_pages(x, kind)
    back = np.asarray(kv_quant.dequantize(*kv_quant.split(pages)))
    assert np.all(np.abs(back - x) <= element_error_bound(x, kind))
    assert np.all(back[0, 0] == 0)
    assert kv_quant.has_scales(kind) == (kind == "int8")
    # Past the format's range fp8 saturates (no NaN); int8 scales any magnitude.
    huge = quantized_pages(np.full((1, 8), 1e9, np.float32), kind)
    got = np.asarray(kv_quant.dequantize(*kv_quant.split(huge)))
    assert np.all(np.isfinite(got))
    if kind != "int8":
        assert got.max() == float(jnp.finfo(kv_quant.storage_dtype(kind, jnp.float32)).max)


def test_stored_bytes_per_token():
    # head_dim 128 in bf16: 256 bytes; int8 128 + a 4-byte scale; fp8 exactly half.
    assert kv_quant.bytes_per_token_head("auto", 128, jnp.bfloat16) == 256
    assert kv_quant.bytes_per_token_head("int8", 128, jnp.bfloat16) == 132
    assert kv_quant.bytes_per_token_head("fp8_e4m3", 128, jnp.bfloat16) == 128
    assert kv_quant.bytes_per_token_head("fp8_e5m2", 128, jnp.float32) == 128
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.validate("int4")


BATCHES = {  # (decode contexts, prefill (cached, chunk) pairs)
    "decode": ([37, 5, 58, 0, 21], []),
    "chunked_prefill": ([], [(24, 9), (0, 17), (41, 1)]),
    "mixed": ([33, 0, 12], [(0, 10), (27, 14)]),
}


def attention_error_bound(q, k, v, kind):
    """Worst-case error of attention over pages stored as ``kind`` against full precision,
    from the format's element bounds ek, ev: a score moves by at most
    ds = max_t |q_t|_1 * max(ek) / sqrt(D), so every softmax weight by a factor within
    exp(+-2 ds), which moves the output by at most (exp(2 ds) - 1) * max|v|; the values'
    own rounding adds max(ev). The log-sum-exp moves by at most ds."""
    ek, ev = (element_error_bound(x, kind).max() for x in (k, v))
    ds = np.abs(q).sum(axis=-1).max() * ek / np.sqrt(q.shape[-1])
    return ev + np.expm1(2 * ds) * np.abs(v).max(), ds


def _check(impl, kind, batch, seed):
    rng = np.random.default_rng(seed)
    decode_ctx, prefill = BATCHES[batch]
    q, kp, vp, meta, _ = ragged_case(rng, decode_ctx, prefill, hq=8, hkv=2, d=64, page_size=4,
                                     width=16)
    full_out, full_lse = jax.jit(reference)(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp),
                                            meta)
    k, v = quantized_pages(kp, kind), quantized_pages(vp, kind)
    ref_out, ref_lse = jax.jit(reference)(jnp.asarray(q), k, v, meta)
    out, lse = jax.jit(KERNELS[impl])(jnp.asarray(q), k, v, meta)
    if impl != "reference":  # the kernel reads the same stored pages as the reference
        np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=2e-5)
    seen = np.isfinite(np.asarray(full_lse))
    assert np.all(np.isneginf(np.asarray(lse))[~seen])  # rows without keys stay empty
    err = np.abs(np.asarray(out) - np.asarray(full_out))[seen]
    lse_err = np.abs(np.asarray(lse)[seen] - np.asarray(full_lse)[seen])
    bound, lse_bound = attention_error_bound(q, kp, vp, kind)
    assert err.max() <= bound + 1e-5, (err.max(), bound)
    assert lse_err.max() <= lse_bound + 1e-5, (lse_err.max(), lse_bound)
    max_err, mean_err, max_lse_err = ERROR_BOUNDS[kind]
    assert err.max() <= max_err and err.mean() <= mean_err and lse_err.max() <= max_lse_err, (
        err.max(), err.mean(), lse_err.max())
    assert err.max() > 0  # the pages really are quantized


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kind", QUANTIZED)
def test_reference_attention_over_quantized_pages_within_bound(kind, batch):
    _check("reference", kind, batch, seed=len(batch) + len(kind))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gpu", "tpu"])
@pytest.mark.parametrize("kind", QUANTIZED)
def test_kernels_over_quantized_pages_match_the_reference_within_bound(impl, kind):
    """The mixed batch holds decodes, a fresh prompt and a chunk after cached tokens."""
    _check(impl, kind, "mixed", seed=len(kind))


@pytest.mark.parametrize("writer", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_write_kernels_match_the_reference_write(writer, kind):
    rng = np.random.default_rng(5)
    hkv, p, s, d = 2, 8, 4, 64
    pages = quantized_pages(rng.normal(size=(hkv, p, s, d)).astype(np.float32), kind)
    slots = jnp.asarray(np.concatenate([rng.permutation(np.arange(s, p * s))[:18], [0, 0]]),
                        jnp.int32)
    new = jnp.asarray(rng.normal(size=(20, hkv, d)) * 3, jnp.float32)
    got = jax.jit(functools.partial(write_kv, impl=writer))(pages, slots, new)
    want = write_kv(pages, slots, new, impl="reference")
    assert jax.tree.structure(got) == jax.tree.structure(pages)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g[:, 1:], np.float32),
                                      np.asarray(w[:, 1:], np.float32))
    # What was written reads back as the new rows within the format's bound.
    back = kv_quant.dequantize(*kv_quant.split(want))
    rows = np.asarray(back).reshape(hkv, p * s, d)[:, np.asarray(slots[:18])].transpose(1, 0, 2)
    assert np.all(np.abs(rows - np.asarray(new[:18])) <= element_error_bound(
        np.asarray(new[:18]), kind))


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("platform, attend, writer, target", [
    ("cuda", pallas_gpu.ragged_paged_attention, kv_write.write_kv_gpu, "__gpu$xla.gpu.triton"),
    ("tpu", pallas_tpu.ragged_paged_attention, kv_write.write_kv_tpu, "tpu_custom_call")])
def test_kernels_lower_with_quantized_pages(platform, attend, writer, target, kind):
    """Triton and Mosaic accept the quantized reads (and the int8 scales' DMAs / loads)."""
    q, kp, vp, meta, export = lowering_case(platform, target)
    k, v = quantized_pages(kp, kind), quantized_pages(vp, kind)
    assert target in export(jax.jit(attend))(jnp.asarray(q, jnp.bfloat16), k, v,
                                             meta).mlir_module()
    values, scales = kv_quant.split(k)
    slots = jnp.arange(5, dtype=jnp.int32) + 16
    new_values, new_scales = kv_quant.quantize(jnp.ones((5, 2, 128)), values.dtype)
    assert target in export(jax.jit(writer))(values, slots, new_values).mlir_module()
    if scales is not None:
        assert target in export(jax.jit(writer))(scales, slots, new_scales).mlir_module()

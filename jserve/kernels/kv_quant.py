"""Quantized KV pages: the stored dtype of the page pool and the scales that come with it.

``kv_cache_dtype`` picks how pages are stored:

- ``auto``: the model's dtype (no quantization).
- ``int8``: symmetric int8 with one float32 scale per (token, KV head): ``x ~= q * scale``,
  ``scale = max|x| / 127`` over the head dim. Integers have no exponent, so a fixed scale
  would waste range on small heads and clip large ones; a per-row scale is computed as the
  row is written (no calibration) and costs 4 bytes per ``head_dim`` values.
- ``fp8_e4m3`` / ``fp8_e5m2``: the float8 formats with one fixed scale of 1 for the whole
  cache (no scale stored). A float format keeps its relative precision (3 or 2 mantissa
  bits) at any magnitude inside its range, so a scale would only move the range: Llama's
  K/V activations sit far inside e4m3's +-448 (e5m2: +-57344). Values past the range
  saturate to it instead of becoming NaN. Exactly half of bf16, and the kernels read no
  scale (vLLM's and sglang's default for fp8 without calibration).

Pages of the ``int8`` kind are a :class:`QuantizedPages` pytree (values and scales with the
same leading dims, the scales' last dim 1), so everything that indexes, shards or swaps pages
by their leading dims (the layer, KV head and page axes) treats both leaves alike: sharding
specs apply as prefixes, swap gathers both. Readers go through :func:`dequantize`.

The page format lives with the kernels (the layer that reads it); the pool
(``jserve.cache.pool``) sizes and allocates pages through it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jserve.config import KV_CACHE_DTYPES

SCALE_DTYPE = np.dtype(np.float32)
_STORED = {"int8": np.dtype(np.int8), "fp8_e4m3": np.dtype(jnp.float8_e4m3fn),
           "fp8_e5m2": np.dtype(jnp.float8_e5m2)}
INT8_MAX = 127.0


def validate(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                         f"got {kv_cache_dtype!r}")
    return kv_cache_dtype


def storage_dtype(kv_cache_dtype: str, model_dtype) -> np.dtype:
    """The dtype page values are stored in."""
    validate(kv_cache_dtype)
    return np.dtype(model_dtype) if kv_cache_dtype == "auto" else _STORED[kv_cache_dtype]


def has_scales(kv_cache_dtype: str) -> bool:
    return validate(kv_cache_dtype) == "int8"


def bytes_per_token_head(kv_cache_dtype: str, head_dim: int, model_dtype) -> int:
    """Stored bytes of one token's K (or V) in one KV head: values plus its scale."""
    values = head_dim * storage_dtype(kv_cache_dtype, model_dtype).itemsize
    return values + (SCALE_DTYPE.itemsize if has_scales(kv_cache_dtype) else 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """int8 pages ``values`` [..., S, D] and their float32 ``scales`` [..., S, 1]."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def sharding(self):
        return self.values.sharding


def _make(shape, kv_cache_dtype: str, model_dtype, leaf):
    dtype = storage_dtype(kv_cache_dtype, model_dtype)
    if not has_scales(kv_cache_dtype):
        return leaf(shape, dtype)
    return QuantizedPages(leaf(shape, dtype), leaf((*shape[:-1], 1), SCALE_DTYPE))


def zeros(shape, kv_cache_dtype: str, model_dtype):
    """Zeroed pages of ``shape`` [..., S, D] stored as ``kv_cache_dtype``."""
    return _make(shape, kv_cache_dtype, model_dtype, jnp.zeros)


def abstract(shape, kv_cache_dtype: str, model_dtype, sharding=None):
    """``jax.ShapeDtypeStruct`` pages (a :class:`QuantizedPages` of them for int8)."""
    return _make(shape, kv_cache_dtype, model_dtype,
                 lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=sharding))


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array | None]:
    """Rows ``x`` [..., D] as stored values of ``dtype`` and their scales [..., 1] (None for
    a dtype stored without scales)."""
    dtype = np.dtype(dtype)
    xf = x.astype(jnp.float32)
    if dtype == np.int8:
        amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
        scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
        q = jnp.clip(jnp.round(xf / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return q, scale.astype(SCALE_DTYPE)
    if dtype in (_STORED["fp8_e4m3"], _STORED["fp8_e5m2"]):
        top = float(jnp.finfo(dtype).max)
        return jnp.clip(xf, -top, top).astype(dtype), None
    return x.astype(dtype), None


def dequantize(values: jax.Array, scales: jax.Array | None, dtype=jnp.float32) -> jax.Array:
    """Stored values (and their scales, broadcast over the last dim) back in ``dtype``."""
    x = values.astype(jnp.float32 if scales is not None else dtype)
    return x if scales is None else (x * scales).astype(dtype)


def split(pages):
    """(values, scales or None) of pages of any kind."""
    if isinstance(pages, QuantizedPages):
        return pages.values, pages.scales
    return pages, None


def relative_error_bound(kv_cache_dtype: str) -> float:
    """Worst relative rounding error of one stored element against the row's max (int8) or
    its own magnitude (fp8, inside the normal range): half a step of the format."""
    return {"auto": 0.0, "int8": 0.5 / INT8_MAX, "fp8_e4m3": 2.0 ** -4,
            "fp8_e5m2": 2.0 ** -3}[validate(kv_cache_dtype)]

"""Moving KV pages between the device cache and host memory (swapping, ``HostKVStore``):
pages move as stored (quantized pages with their scales: every leaf of the cache has the
page axis third), their ids padded to a power of two with the reserved sink page 0, so
swapping compiles one gather and one scatter per size class."""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from jserve.cache.pool import KVCache


def read_pages(kv_cache: KVCache, pages: Sequence[int]):
    """Host copies (k, v) of ``pages`` in every layer ([layers, Hkv, len(pages), S, D]),
    as stored (quantized pages: values and scales)."""
    ids = _padded_page_ids(pages)
    data = jax.device_get(_gather_pages(kv_cache, ids))
    return jax.tree.map(lambda x: x[:, :, :len(pages)], data)


def write_pages(kv_cache: KVCache, pages: Sequence[int], data) -> KVCache:
    """``kv_cache`` (donated) with ``pages`` set to ``data`` (``read_pages``'s form)."""
    ids = _padded_page_ids(pages)
    widths = ((0, 0), (0, 0), (0, len(ids) - len(pages)), (0, 0), (0, 0))
    data = jax.tree.map(lambda x: np.pad(x, widths), data)
    return _scatter_pages(kv_cache, ids, data)


def _padded_page_ids(pages: Sequence[int]) -> np.ndarray:
    ids = np.zeros(1 << max(len(pages) - 1, 0).bit_length(), np.int32)
    ids[:len(pages)] = pages
    return ids


@jax.jit
def _gather_pages(kv_cache: KVCache, ids: jax.Array) -> KVCache:
    return jax.tree.map(lambda pages: pages[:, :, ids], kv_cache)


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_pages(kv_cache: KVCache, ids: jax.Array, data: KVCache) -> KVCache:
    return jax.tree.map(lambda pages, new: pages.at[:, :, ids].set(new), kv_cache, data)

"""Moving KV pages between the device cache and host memory (swapping, ``HostKVStore``):
pages move as stored (quantized pages with their scales: every leaf of the cache has the
page axis third), ``SWAP_CHUNK`` pages per call, the last call's ids padded with the reserved
sink page 0. So swapping has one gather and one scatter program whatever the page count (it
had one per power of two, compiled in the foreground the first time a swap of that size
came): ``StepPrograms.warmup`` compiles both with the step programs at start
(``lower_movers``); without them the jitted functions compile once on first use."""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jserve.cache.pool import KVCache, formats

# Pages per call of a swap program. Larger moves a long request's pages in fewer calls;
# smaller wastes less on a short one (a call moves the whole chunk: at 8B, bf16, about 2 MB
# a page).
SWAP_CHUNK = 32


class PageMovers(NamedTuple):
    """The compiled gather (``read``: (kv, ids) -> pages) and scatter (``write``: (kv
    donated, ids, pages) -> kv) of ``SWAP_CHUNK`` pages."""

    read: Callable
    write: Callable


def _chunks(pages: Sequence[int]):
    """(offset, pages in the chunk, its ``SWAP_CHUNK`` ids padded with the sink page 0); no
    pages: one chunk of padding (the moved data then has no pages, as asked)."""
    for lo in range(0, max(len(pages), 1), SWAP_CHUNK):
        part = list(pages[lo:lo + SWAP_CHUNK])
        ids = np.zeros(SWAP_CHUNK, np.int32)
        ids[:len(part)] = part
        yield lo, len(part), ids


def unmovable(alloc, spp: int, multi_process: bool) -> str | None:
    """Why pages of the pool ``alloc`` manages cannot be copied out and written back by
    content key (the host tier's, and pages sent to another engine); None when they can."""
    return ("prefix caching is off" if not alloc.prefix_caching else
            "not with a stream pipeline (spp > 1)" if spp > 1 else
            "not with several processes" if multi_process else
            "not with a sliding window yet" if alloc.window is not None else None)


def read_pages(kv_cache: KVCache, pages: Sequence[int], movers: PageMovers | None = None):
    """Host copies (k, v) of ``pages`` in every layer ([layers, Hkv, len(pages), S, D]),
    as stored (quantized pages: values and scales)."""
    return finish_read(start_read(kv_cache, pages, movers))


def start_read(kv_cache: KVCache, pages: Sequence[int], movers: PageMovers | None = None):
    """``read_pages`` without waiting: the gathers are dispatched and their copies to the
    host started; ``finish_read`` waits for them (the prefix cache's host tier reads a
    step later, so the copy overlaps the device's work)."""
    gather = movers.read if movers is not None else _gather_pages
    parts = [(n, gather(kv_cache, ids)) for _, n, ids in _chunks(pages)]  # all dispatched
    for _, p in parts:
        for x in jax.tree.leaves(p):
            x.copy_to_host_async()
    return parts


def finish_read(parts):
    """The host copies ``start_read`` began, as ``read_pages`` returns them."""
    host = jax.device_get([p for _, p in parts])
    trimmed = [jax.tree.map(lambda x, n=n: x[:, :, :n], h) for (n, _), h in zip(parts, host)]
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=2), *trimmed)


def padded_chunks(pages: Sequence[int], data) -> list:
    """(ids, ``data``'s pages of the chunk padded to ``SWAP_CHUNK``) per scatter call."""
    def padded(x, lo: int, n: int):
        return np.pad(np.asarray(x)[:, :, lo:lo + n],
                      ((0, 0), (0, 0), (0, SWAP_CHUNK - n), (0, 0), (0, 0)))

    return [(ids, jax.tree.map(lambda x, lo=lo, n=n: padded(x, lo, n), data))
            for lo, n, ids in _chunks(pages)]


def scatter_chunks(kv_cache: KVCache, chunks: list, movers: PageMovers | None = None
                   ) -> KVCache:
    """``kv_cache`` (donated) with each of ``padded_chunks``' chunks written (its data on
    the host or already on the device)."""
    scatter = movers.write if movers is not None else _scatter_pages
    for ids, part in chunks:
        kv_cache = scatter(kv_cache, ids, part)
    return kv_cache


def write_pages(kv_cache: KVCache, pages: Sequence[int], data,
                movers: PageMovers | None = None) -> KVCache:
    """``kv_cache`` (donated) with ``pages`` set to ``data`` (``read_pages``'s form)."""
    return scatter_chunks(kv_cache, padded_chunks(pages, data), movers)


def _gather(kv_cache: KVCache, ids: jax.Array) -> KVCache:
    return jax.tree.map(lambda pages: pages[:, :, ids], kv_cache)


def _scatter(kv_cache: KVCache, ids: jax.Array, data: KVCache) -> KVCache:
    return jax.tree.map(lambda pages, new: pages.at[:, :, ids].set(new), kv_cache, data)


_gather_pages = jax.jit(_gather)
_scatter_pages = jax.jit(_scatter, donate_argnums=(0,))


def lower_movers(kv_spec: KVCache, replicated) -> tuple[jax.stages.Lowered,
                                                        Callable[[jax.stages.Compiled],
                                                                 jax.stages.Lowered]]:
    """The gather lowered against the KV cache's specs (``ShapeDtypeStruct``s with their
    shardings), and a function lowering the scatter once the gather is compiled (its
    pages input takes the gather's output shardings). ``replicated``: the ids' sharding
    (None on one device)."""
    ids = jax.ShapeDtypeStruct((SWAP_CHUNK,), jnp.int32, sharding=replicated)
    gather = jax.jit(_gather).lower(kv_spec, ids)

    def scatter(compiled_gather: jax.stages.Compiled) -> jax.stages.Lowered:
        out = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape[:2] + (SWAP_CHUNK,) + x.shape[3:],
                                              x.dtype, sharding=s),
            kv_spec, compiled_gather.output_shardings)
        pinned = formats(kv_spec)  # a pinned pool comes back in its layout
        return jax.jit(_scatter, donate_argnums=(0,),
                       **({} if pinned is None else dict(out_shardings=pinned))
                       ).lower(kv_spec, ids, out)

    return gather, scatter


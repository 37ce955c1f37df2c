"""KV pages in host memory: the two stores that carry out the page copies a plan names,
before its step runs. The scheduler decides; these move the bytes with ``page_io``'s gather
and scatter of ``SWAP_CHUNK`` pages (compiled at start with the steps).

- ``HostKVStore``: copies of swapped-out pages (``jserve.scheduler.swap`` decides who
  swaps), held per request until it swaps back in. Swap-outs go first: the plan may reuse
  the pages they free.
- ``HostKVTier``: the prefix cache's host tier (``jserve.cache.host_tier`` decides which
  page lives in which host slot).
  - **Offload** (device -> host): the gathers are dispatched and their copies to the host
    started (``page_io.start_read``); the bytes land in the slots later (``finish``: at the
    next plan, or at once when a restore needs them), so the host does not wait on the
    device for them.
  - **Restore** (host -> device): the slots' bytes are put on the device and scattered into
    the fresh pages; the step after them reads them in order. On one device the transfer is
    timed (it does not wait on the step in flight) and teaches ``CopyRate`` the link's
    bandwidth, which prices a restore for the deadline policies.

Pages move as stored (quantized pages with their scales) and whole: on a mesh every shard's
part of a page (its tp heads, its kvp group's pool) lands in one host page, and a restore
writes each shard its own part back."""
from __future__ import annotations

import logging
import time

import jax
import numpy as np

from jserve.cache.host_tier import HostTier
from jserve.cache.pool import kv_bytes_per_page
from jserve.config import ModelConfig
from jserve.copy_rate import CopyRate
from jserve.engine.config import EngineConfig
from jserve.engine.device import page_io
from jserve.engine.loop.timing import host_copy_rate
from jserve.scheduler import BatchPlan
from sharding.specs import kv_head_map

log = logging.getLogger(__name__)


class HostKVStore:
    def __init__(self, runner):
        self.runner = runner
        self.copies: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def apply(self, plan: BatchPlan) -> None:
        for rid, pages in plan.swap_out:
            self.copies[rid] = self.runner.read_pages(pages)
        for rid, pages in plan.swap_in:
            self.runner.write_pages(pages, self.copies.pop(rid))

    def drop(self, request_id: str) -> None:
        self.copies.pop(request_id, None)


def build_host_tier(cfg: ModelConfig, config: EngineConfig, parts) -> HostKVTier | None:
    """The host tier ``config.kv_offload_bytes`` asks for, attached to the engine's allocator
    and scheduler (``parts``: ``factory.EngineParts``); None when off or not supported (like
    swapping: one process, no pipeline; and not under a sliding window yet)."""
    if not config.kv_offload_bytes:
        return None
    alloc, mesh_config = parts.allocator, parts.mesh_config
    why = page_io.unmovable(alloc, mesh_config.spp, parts.multi_process)
    # A host page is a global page: every stored KV head (copies under tp included).
    page_bytes = kv_bytes_per_page(cfg, config.page_size, len(kv_head_map(cfg, mesh_config.tp)),
                                   kv_cache_dtype=config.kv_cache_dtype)
    pages = config.kv_offload_bytes // page_bytes
    if why is None and pages == 0:
        why = f"{config.kv_offload_bytes} bytes hold no page of {page_bytes}"
    if why is not None:
        log.warning("the KV host tier (kv_offload_bytes) is off: %s", why)
        return None
    alloc.host = HostTier(pages)
    rate, chunk = host_copy_rate(), page_io.SWAP_CHUNK
    # A restore moves whole chunks of SWAP_CHUNK pages.
    parts.scheduler.restore_seconds = lambda n: rate.seconds(-(-n // chunk) * chunk * page_bytes)
    return HostKVTier(parts.runner, pages, page_bytes, rate, on_mesh=mesh_config.size > 1)


class HostKVTier:
    def __init__(self, runner, num_pages: int, page_bytes: int, rate: CopyRate,
                 on_mesh: bool = False):
        self.runner, self.page_bytes, self.rate = runner, page_bytes, rate
        self.on_mesh = on_mesh  # restores go as host arrays (each shard takes its part)
        # Per leaf of the cache ([layers, Hkv, pages, S, D]) its host slots, slot first
        # ([slots, layers, Hkv, S, D]: a slot's page is one contiguous block to write and
        # read). Zeros are mapped lazily, so only slots written take memory.
        self.slots = jax.tree.map(
            lambda x: np.zeros((num_pages,) + x.shape[:2] + x.shape[3:], x.dtype),
            runner.kv_cache)
        self._pending: list[tuple[tuple[int, ...], list]] = []  # offloads not yet landed
        self.offloaded_pages = self.restored_pages = 0
        self.restore_seconds = 0.0  # timed host -> device transfers, summed

    def offload(self, plan: BatchPlan) -> None:
        """Starts copying ``plan.offload``'s pages out (before anything overwrites them);
        the last plan's offloads land first (their gathers ran before its step, so taking
        them costs no wait on the step in flight)."""
        self.finish()
        if not plan.offload:
            return
        pages, slots = zip(*plan.offload)
        parts = page_io.start_read(self.runner.kv_cache, pages, self.runner.programs.movers)
        self._pending.append((slots, parts))
        self.offloaded_pages += len(pages)

    def finish(self) -> None:
        """The started offloads' bytes into their slots, in plan order (a slot reused by a
        later offload ends with the later page)."""
        for slots, parts in self._pending:
            data = page_io.finish_read(parts)
            for buf, x in zip(jax.tree.leaves(self.slots), jax.tree.leaves(data)):
                buf[list(slots)] = np.moveaxis(x, 2, 0)
        self._pending.clear()

    def restore(self, plan: BatchPlan) -> None:
        """Writes ``plan.restore``'s host pages into their fresh device pages."""
        if not plan.restore:
            return
        slots, pages = zip(*plan.restore)
        if self._pending:  # a restore may read a slot an offload is still filling
            self.finish()
        data = jax.tree.map(lambda buf: np.moveaxis(buf[list(slots)], 0, 2), self.slots)
        chunks = page_io.padded_chunks(pages, data)
        if not self.on_mesh:
            t0 = time.perf_counter()
            placed = jax.block_until_ready(jax.device_put([c for _, c in chunks]))
            seconds = time.perf_counter() - t0
            self.rate.observe(len(chunks) * page_io.SWAP_CHUNK * self.page_bytes, seconds)
            self.restore_seconds += seconds
            chunks = [(ids, c) for (ids, _), c in zip(chunks, placed)]
        runner = self.runner
        runner.kv_cache = page_io.scatter_chunks(runner.kv_cache, chunks,
                                                 runner.programs.movers)
        self.restored_pages += len(pages)

    def stats(self, scheduler) -> dict:
        """Totals since start, for the metrics (read at each scrape): prompt tokens looked up
        and found per tier, pages and bytes moved each way, timed restore seconds, the host
        pool's pages and the copy rate learned."""
        host = scheduler.allocator.host
        hits = scheduler.prefix_hit_tokens
        return dict(queried_tokens=scheduler.prefix_queried_tokens,
                    device_hit_tokens=hits - scheduler.prefix_host_hit_tokens,
                    host_hit_tokens=scheduler.prefix_host_hit_tokens,
                    offloaded_pages=self.offloaded_pages, restored_pages=self.restored_pages,
                    offloaded_bytes=self.offloaded_pages * self.page_bytes,
                    restored_bytes=self.restored_pages * self.page_bytes,
                    restore_seconds=self.restore_seconds, host_pages_used=host.num_used,
                    host_pages_total=host.capacity, host_evictions=host.num_evictions,
                    copy_bytes_per_s=self.rate.bytes_per_s)

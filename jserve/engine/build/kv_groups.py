"""Whether an engine runs two KV layer groups (``jserve.cache.hybrid``: a model with windowed
and full-attention layers, Gemma 3, frees its windowed layers' passed pages) and how big each
group's pool is. Configurations the groups are not built for keep every page, as before,
with one start-up warning naming why."""
from __future__ import annotations

import dataclasses
import logging

import jax

from jserve.cache.allocator import held_pages
from jserve.cache.hybrid import HybridAllocator, local_window, split_pages
from jserve.cache.pool import num_pages_for_budget
from jserve.config import ModelConfig
from jserve.engine.config import EngineConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """The two pools, in pages with their sinks: the full-attention layers' and the
    windowed layers' (``window`` tokens)."""

    global_pages: int
    local_pages: int
    window: int

    def allocator(self, page_size: int, prefix_caching: bool,
                  max_chunk: int) -> HybridAllocator:
        return HybridAllocator(self.global_pages, self.local_pages, page_size, self.window,
                               prefix_caching=prefix_caching, max_chunk=max_chunk)


def why_not(config: EngineConfig, mesh_size: int, layer_mode: str) -> str | None:
    """Why a two-group model keeps every page under ``config`` (None: it need not)."""
    if mesh_size > 1 or jax.process_count() > 1:
        return "a multi-device mesh or several processes"
    if config.preemption == "swap":
        return "preemption='swap'"
    if config.kv_offload_bytes > 0:
        return "the prefix cache's host tier (kv_offload_bytes)"
    if config.speculative_config is not None:
        return "speculative decoding"
    if layer_mode in ("loop", "indexed", "sliced-indexed"):
        return f"layer_loop {layer_mode!r} (the groups need the layers unrolled or sliced)"
    return None


def group_window(cfg: ModelConfig, config: EngineConfig, *, mesh_size: int, layer_mode: str,
                 warn: bool = True) -> int | None:
    """The windowed layers' window when ``cfg`` has windowed and full-attention layers and
    ``config`` is one the groups run under; else None (``warn``: a warning says why for
    such a model)."""
    window = local_window(cfg)
    if window is None:
        return None
    why = why_not(config, mesh_size, layer_mode)
    if why is not None:
        if warn:
            log.warning("every KV page of a request is kept (the windowed layers' passed "
                        "pages are not freed) under %s", why)
        return None
    return window


def layer_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(full-attention layers, windowed layers)."""
    num_local = sum(1 for w in cfg.layer_windows if w)
    return cfg.num_hidden_layers - num_local, num_local


def useful_pages(cfg: ModelConfig, config: EngineConfig, window: int, max_model_len: int,
                 max_chunk: int) -> tuple[int, int]:
    """Pages of (global, local) group every sequence slot at full context holds at most."""
    ps = config.page_size
    return (config.max_num_seqs * -(-max_model_len // ps),
            config.max_num_seqs * held_pages(max_model_len, ps, window, max_chunk))


def pool_sizes(cfg: ModelConfig, config: EngineConfig, window: int, max_model_len: int,
               max_chunk: int, layer_pages: int | None = None) -> tuple[int, int]:
    """(global, local) pools in pages, sinks included: ``num_kv_pages`` and
    ``num_local_kv_pages`` where set (the local one, unset, scaled from the global one as
    ``split_pages`` would), else ``split_pages`` of a budget of ``layer_pages`` (one page
    of one layer each)."""
    useful_global, useful_local = useful_pages(cfg, config, window, max_model_len, max_chunk)
    if config.num_kv_pages is not None:
        glob = config.num_kv_pages
        return glob, config.num_local_kv_pages or max(2, min(glob, -(
            -(glob - 1) * useful_local // useful_global) + 1))
    return split_pages(layer_pages, *layer_counts(cfg), useful_global, useful_local)


def kv_groups(cfg: ModelConfig, config: EngineConfig, *, mesh_size: int, layer_mode: str,
              max_model_len: int, max_chunk: int) -> KVGroups | None:
    """The engine's two pools (``group_window`` says when), the budget as
    ``num_pages_for_budget`` reads it; None: one group."""
    window = group_window(cfg, config, mesh_size=mesh_size, layer_mode=layer_mode)
    if window is None:
        return None
    layer_pages = None
    if config.num_kv_pages is None:
        useful_global, useful_local = useful_pages(cfg, config, window, max_model_len,
                                                   max_chunk)
        num_global, num_local = layer_counts(cfg)
        layer_pages = num_pages_for_budget(
            cfg, config.page_size, kv_cache_bytes=config.kv_cache_bytes,
            memory_fraction=config.memory_fraction, num_layers=1,
            max_useful_pages=useful_global * num_global + useful_local * num_local
            + cfg.num_hidden_layers, kv_cache_dtype=config.kv_cache_dtype)
    glob, local = pool_sizes(cfg, config, window, max_model_len, max_chunk, layer_pages)
    if min(glob, local) < 2:
        raise ValueError(f"KV cache budget holds {glob} global and {local} local pages of "
                         f"{config.page_size} tokens; need >= 2 of each")
    return KVGroups(glob, local, window)

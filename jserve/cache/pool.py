"""The device page pool: layout, sizing from a memory budget, allocation."""
from __future__ import annotations

import os
from typing import NamedTuple

import jax

from jserve.config import ModelConfig
from jserve.kernels import kv_quant

# (k_pages, v_pages), each [layers, Hkv, P, S, D]: stacked like the runtime params, so the
# model's layer loop reads and writes layer i in place (jserve.model.decoder.layer_loop). With
# kv_cache_dtype="int8" each is a kv_quant.QuantizedPages (values and per-row scales).
KVCache = tuple[jax.Array | kv_quant.QuantizedPages, jax.Array | kv_quant.QuantizedPages]


class HybridKV(NamedTuple):
    """The KV pages of two layer groups (``jserve.cache.hybrid``), each its own
    (k_pages, v_pages) [group's layers, Hkv, group's pages, S, D]: the full-attention
    layers' and the windowed layers'. A step's programs take it where they take a KVCache."""

    glob: KVCache
    loc: KVCache


def pages_row_major(platform: str, attention: str) -> bool:
    """Whether the pool is pinned row-major: on a TPU under the Pallas kernels, which take
    their operands row-major, where XLA's default TPU layout for a minor dimension under
    128 (head dim 64, int8 pages' scales) is not and every step relaid the whole pool out
    and back (2.28 GB a step for a 1.14 GB pool at 1B on a v5e: ``jserve compile``)."""
    return platform == "tpu" and attention == "pallas_tpu"


def row_major(specs, zeros: bool = False):
    """Each page spec of ``specs`` pinned row-major (its sharding a row-major ``Format``);
    ``zeros``: instead the zeroed pages, made in that layout on their devices."""
    from jax.experimental.layout import Format, Layout

    def pin(x):
        sharding = x.sharding if not hasattr(x.sharding, "layout") else x.sharding.sharding
        fmt = Format(Layout(major_to_minor=tuple(range(len(x.shape)))), sharding)
        if zeros:
            return jax.jit(lambda: jax.numpy.zeros(x.shape, x.dtype), out_shardings=fmt)()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fmt)

    return jax.tree.map(pin, specs)


def formats(tree):
    """The row-major ``Format``s of ``tree``'s pinned page specs (``row_major``), as a
    program's out_shardings for the pages it returns; None when none is pinned."""
    leaves = jax.tree.leaves(tree)
    if not leaves or getattr(leaves[0], "format", None) is None \
            or getattr(leaves[0].format, "layout", None) is None:
        return None
    return jax.tree.map(lambda x: x.format, tree)


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, kv_heads: int | None = None,
                      num_layers: int | None = None, kv_cache_dtype: str = "auto") -> int:
    """Stored bytes of one page over ``num_layers`` layers (K and V) holding ``kv_heads``
    heads (defaults: the model's; a tensor-parallel device stores its share of the heads, a
    pipeline stage its layers, see ``sharding.specs`` and ``sharding.pipeline``), values and
    scales at the ``kv_cache_dtype`` they are stored in (``jserve.kernels.kv_quant``)."""
    heads = cfg.num_key_value_heads if kv_heads is None else kv_heads
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    return 2 * layers * heads * page_size * kv_quant.bytes_per_token_head(
        kv_cache_dtype, cfg.head_dim, cfg.np_dtype)


def available_device_bytes(device: jax.Device) -> int:
    """Free accelerator memory; on CPU (no memory stats) the host's available RAM."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# On CPU the "device memory" is the host's RAM, shared with everything else on it, and every
# page is zeroed at start (about 0.4 s per GB on an idle 2-core host, several times that
# under load): without an explicit budget the pool takes at most this much there.
CPU_KV_BUDGET_BYTES = 4 << 30


def total_host_bytes() -> int:
    """The host's physical RAM: fixed for the machine, unlike its free RAM."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_kv_budget(memory_fraction: float) -> int:
    """The CPU pool's default budget: ``memory_fraction`` of the host's *total* RAM, at most
    ``CPU_KV_BUDGET_BYTES``. Free RAM moves with whatever else runs, and with it the pool,
    every step program's KV shape and the swap pressure; total RAM does not, so the pool,
    the program set and the memory plan are the same on every start of a machine (and the
    same 4 GiB on any host with 8 GiB or more at the default fraction)."""
    return min(int(total_host_bytes() * memory_fraction), CPU_KV_BUDGET_BYTES)


def stable_page_count(pages: int, steps_per_octave: int = 8) -> int:
    """``pages`` rounded down to one of ``steps_per_octave`` sizes per power of two (at most
    1/8 fewer). A pool sized from free memory, which moves with everything else on the
    host, would otherwise change size from one start to the next, and with it the shape of
    every step program: a restart would miss the persistent compilation cache."""
    if pages < 2 * steps_per_octave:
        return pages
    grain = 1 << (pages.bit_length() - 1 - steps_per_octave.bit_length() + 1)
    return pages // grain * grain


def num_pages_for_budget(cfg: ModelConfig, page_size: int, *, kv_cache_bytes: int | None,
                         memory_fraction: float, max_useful_pages: int,
                         kv_heads: int | None = None, num_layers: int | None = None,
                         kv_cache_dtype: str = "auto") -> int:
    """Pages that fit one device's budget: an explicit byte count, else a fraction of its free
    memory (on CPU of the host's total RAM, ``cpu_kv_budget``), rounded by
    ``stable_page_count``;
    ``kv_heads`` and ``num_layers`` are what a device stores per page (``kv_bytes_per_page``).

    Capped at ``max_useful_pages`` (every sequence slot at full context) plus the reserved
    page, so a small model on a large host does not grab memory it can never use. With
    KV-cache parallelism this is one group's pool (each group's pool is on its own devices).
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    budget = kv_cache_bytes
    fits = None
    if budget is None:
        device = jax.local_devices()[0]
        budget = (cpu_kv_budget(memory_fraction) if device.platform == "cpu"
                  else int(available_device_bytes(device) * memory_fraction))
        fits = stable_page_count(budget // kv_bytes_per_page(cfg, page_size, kv_heads,
                                                             num_layers, kv_cache_dtype))
    if fits is None:
        fits = budget // kv_bytes_per_page(cfg, page_size, kv_heads, num_layers,
                                           kv_cache_dtype)
    pages = min(fits, max_useful_pages + 1)
    if pages < 2:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds {pages} pages of {page_size} tokens; "
            "need >= 2")
    return int(pages)


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int,
                   kv_heads: int | None = None) -> tuple[int, ...]:
    heads = cfg.num_key_value_heads if kv_heads is None else kv_heads
    return (cfg.num_hidden_layers, heads, num_pages, page_size, cfg.head_dim)


def allocate_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int,
                      kv_cache_dtype: str = "auto", local_pages: int | None = None
                      ) -> KVCache | HybridKV:
    """The zeroed pages; ``local_pages``: two layer groups (``HybridKV``), ``num_pages``
    for the full-attention layers and ``local_pages`` for the windowed ones."""
    if local_pages is not None:
        return HybridKV(*(_zeros(shape, cfg, kv_cache_dtype) for shape in
                          hybrid_kv_shapes(cfg, num_pages, local_pages, page_size)))
    return _zeros(kv_cache_shape(cfg, num_pages, page_size), cfg, kv_cache_dtype)


def _zeros(shape: tuple[int, ...], cfg: ModelConfig, kv_cache_dtype: str) -> KVCache:
    return (kv_quant.zeros(shape, kv_cache_dtype, cfg.np_dtype),
            kv_quant.zeros(shape, kv_cache_dtype, cfg.np_dtype))


def hybrid_kv_shapes(cfg: ModelConfig, num_pages: int, local_pages: int, page_size: int
                     ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (global, local) groups' stacked page shapes (one device)."""
    num_local = sum(1 for w in cfg.layer_windows if w)
    full = kv_cache_shape(cfg, num_pages, page_size)
    return ((cfg.num_hidden_layers - num_local, *full[1:]),
            (num_local, full[1], local_pages, *full[3:]))

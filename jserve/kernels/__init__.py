"""Attention for a mixed ragged batch over the paged KV cache.

``attention`` is the one call site the model uses; ``impl`` picks the implementation:
``reference`` (pure jnp, any backend), ``pallas_gpu`` (Triton), ``pallas_tpu`` (Mosaic),
``cpu`` (the reference with its decode rows on a native kernel for XLA:CPU, ``cpu.py``), or
``auto``: the backend's kernel where it has run on that hardware: ``pallas_gpu`` on GPU,
``cpu`` on CPU where its kernel builds, else (TPU until ``pallas_tpu`` has run on one) the
reference. ``write_kv``, the
cache write before attention, follows the same choice. A Pallas flavour
asked for on another backend (CPU in tests) runs in Pallas interpret mode: same kernel code,
executed by XLA, slow but exact, which is how the engine is tested with the kernels.
``kv_parallel`` runs ``attention`` on one KV-cache-parallel group's pages and merges the
groups' partial results. Pages may be stored quantized (``kv_quant``: int8 with per-row
scales, fp8); every implementation dequantizes the KV pages it reads, inside the kernel.
"""
from __future__ import annotations

import dataclasses

import jax

from jserve import backend as jserve_backend
from jserve.kernels import cpu, kv_quant, kv_write, pallas_gpu, pallas_tpu
from jserve.kernels.metadata import AttentionMetadata
from jserve.kernels.reference import ragged_paged_attention

ATTENTION_IMPLS = ("auto", "reference", "pallas_gpu", "pallas_tpu", "cpu")
# impl -> (backend it compiles for, attention kernel, cache-write kernel)
_KERNELS = {"pallas_gpu": ("gpu", pallas_gpu.ragged_paged_attention, kv_write.write_kv_gpu),
            "pallas_tpu": ("tpu", pallas_tpu.ragged_paged_attention, kv_write.write_kv_tpu)}


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The concrete implementation ``impl`` stands for on ``backend`` (default: JAX's)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; choose from {ATTENTION_IMPLS}")
    if impl != "auto":
        return impl
    backend = backend or jserve_backend.current()
    if backend == "cpu":
        return "cpu" if cpu.available() else "reference"
    # TPU: the Pallas kernels compile inside the engine's steps for v5e and v6e
    # (tests/test_targets.py); XLA's reference relaid the whole pool out every layer there.
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "reference")


def attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata,
              impl: str = "reference", layer=None, window=None) -> tuple[jax.Array, jax.Array]:
    """Returns (output [T, Hq, D], log-sum-exp [T, Hq]). Pages are one layer's
    [Hkv, P, S, D], or with ``layer`` (may be traced) a stacked cache [layers, Hkv, P, S, D]
    read at that layer in place: every implementation addresses the layer itself, since a
    slice of the stacked cache is a copy of the layer's whole pool (docs/device.md).

    ``window``: the layer's sliding window, an int32 scalar (may be traced; 0: full
    attention): a query at position p reads the keys at p - window < k <= p, and every
    implementation skips the pages wholly before its queries' windows without reading them
    or their page-table entries' pages (they may be freed). None: no window code at all."""
    impl = resolve_impl(impl)
    if impl == "reference":
        return ragged_paged_attention(q, k_pages, v_pages, meta, layer=layer, window=window)
    if impl == "cpu":
        return cpu.ragged_paged_attention(q, k_pages, v_pages, meta, layer=layer,
                                          window=window)
    backend, kernel, _ = _KERNELS[impl]
    return kernel(q, k_pages, v_pages, meta, interpret=jserve_backend.current() != backend,
                  layer=layer, window=window)


def with_row_layouts(meta: AttentionMetadata, impl: str, group: int) -> AttentionMetadata:
    """``meta`` carrying its Pallas kernel's query blocking (``AttentionMetadata.row_layouts``)
    for ``group`` query heads a KV head, made here once so a layer loop does not make it in
    every layer (XLA kept it in the loop's body); unchanged for the other kernels."""
    impl = resolve_impl(impl)
    make = {"pallas_gpu": pallas_gpu.row_layouts, "pallas_tpu": pallas_tpu.row_layouts}.get(impl)
    if make is None:
        return meta
    return dataclasses.replace(meta, row_layouts=make(meta, group))


def write_slots(slots: jax.Array, impl: str) -> jax.Array:
    """``slots`` as ``impl``'s cache write takes them, for a step to make once before its
    layer loop (the GPU kernel's are padded to its blocks)."""
    return kv_write.gpu_slots(slots) if resolve_impl(impl) == "pallas_gpu" else slots


def _write(pages: jax.Array, slots: jax.Array, new: jax.Array, impl: str, layer) -> jax.Array:
    if impl in ("reference", "cpu"):
        return kv_write.write_kv(pages, slots, new, layer=layer)
    backend, _, kernel = _KERNELS[impl]
    return kernel(pages, slots, new, interpret=jserve_backend.current() != backend,
                  layer=layer)


def _write_all(pairs, slots: jax.Array, impl: str, layer) -> list:
    """Each (pages, new rows) of ``pairs`` written at ``slots``: the rows quantized to the
    pages' stored dtype first (``kv_quant``), int8 pages' scales written to the same slots.
    The GPU kernel writes every array in one launch; the others, each in turn."""
    impl = resolve_impl(impl)
    leaves = []  # (stored array, its new rows), a pair's values then its scales
    for pages, new in pairs:
        values, scales = kv_quant.split(pages)
        stored, new_scales = kv_quant.quantize(new, values.dtype)
        leaves += [(values, stored)] + ([] if scales is None else [(scales, new_scales)])
    if impl == "pallas_gpu":
        written = list(kv_write.write_kv_gpu(
            tuple(a for a, _ in leaves), slots, tuple(b for _, b in leaves), layer=layer,
            interpret=jserve_backend.current() != "gpu"))
    else:
        written = [_write(a, slots, b, impl, layer) for a, b in leaves]
    out = []
    for pages, _ in pairs:
        if isinstance(pages, kv_quant.QuantizedPages):
            out.append(kv_quant.QuantizedPages(written.pop(0), written.pop(0)))
        else:
            out.append(written.pop(0))
    return out


def write_kv(pages, slots: jax.Array, new: jax.Array, impl: str = "reference", layer=None):
    """Writes new [T, Hkv, D] into pages [Hkv, P, S, D] at flat slots [T]; with ``layer``,
    into layer ``layer`` of a stacked cache [layers, Hkv, P, S, D] (returned whole). The rows
    are quantized to the pages' stored dtype first (``kv_quant``); int8 pages get their rows'
    scales written to the same slots."""
    return _write_all([(pages, new)], slots, impl, layer)[0]


def write_kv_pair(k_pages, v_pages, slots: jax.Array, k: jax.Array, v: jax.Array,
                  impl: str = "reference", layer=None):
    """``write_kv`` of a layer's K and V at the same slots -> (k_pages, v_pages); on a GPU in
    one launch (a launch a layer fewer in every step)."""
    k_pages, v_pages = _write_all([(k_pages, k), (v_pages, v)], slots, impl, layer)
    return k_pages, v_pages


__all__ = ["AttentionMetadata", "attention", "write_kv", "write_kv_pair", "write_slots",
           "resolve_impl", "with_row_layouts", "ATTENTION_IMPLS"]

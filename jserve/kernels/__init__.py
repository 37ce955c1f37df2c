"""Attention for a mixed ragged batch over the paged KV cache.

``attention`` is the one call site the model uses; ``impl`` picks the implementation:
``reference`` (pure jnp, any backend), ``pallas_gpu`` (Triton), ``pallas_tpu`` (Mosaic), or
``auto``: the Pallas flavour of the backend JAX runs on, else the reference. ``write_kv``, the
cache write before attention, follows the same choice. A Pallas flavour
asked for on another backend (CPU in tests) runs in Pallas interpret mode: same kernel code,
executed by XLA, slow but exact, which is how the engine is tested with the kernels.
``kv_parallel`` runs ``attention`` on one KV-cache-parallel group's pages and merges the
groups' partial results.
"""
from __future__ import annotations

import jax

from jserve.kernels import kv_write, pallas_gpu, pallas_tpu
from jserve.kernels.metadata import AttentionMetadata
from jserve.kernels.reference import ragged_paged_attention

ATTENTION_IMPLS = ("auto", "reference", "pallas_gpu", "pallas_tpu")
# impl -> (backend it compiles for, attention kernel, cache-write kernel)
_KERNELS = {"pallas_gpu": ("gpu", pallas_gpu.ragged_paged_attention, kv_write.write_kv_gpu),
            "pallas_tpu": ("tpu", pallas_tpu.ragged_paged_attention, kv_write.write_kv_tpu)}


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The concrete implementation ``impl`` stands for on ``backend`` (default: JAX's)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; choose from {ATTENTION_IMPLS}")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    return next((name for name, (b, *_) in _KERNELS.items() if b == backend), "reference")


def _layer(pages: jax.Array, layer) -> jax.Array:
    return pages if layer is None else jax.lax.dynamic_index_in_dim(pages, layer, keepdims=False)


def attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata,
              impl: str = "reference", layer=None) -> tuple[jax.Array, jax.Array]:
    """Returns (output [T, Hq, D], log-sum-exp [T, Hq]). Pages are one layer's
    [Hkv, P, S, D], or with ``layer`` (may be traced) a stacked cache [layers, Hkv, P, S, D]
    read at that layer. The reference gathers straight from the stacked cache; the Pallas
    kernels are handed the layer's slice (a copy unless XLA elides it; docs/startup.md)."""
    impl = resolve_impl(impl)
    if impl == "reference":
        return ragged_paged_attention(q, k_pages, v_pages, meta, layer=layer)
    backend, kernel, _ = _KERNELS[impl]
    return kernel(q, _layer(k_pages, layer), _layer(v_pages, layer), meta,
                  interpret=jax.default_backend() != backend)


def write_kv(pages: jax.Array, slots: jax.Array, new: jax.Array,
             impl: str = "reference", layer=None) -> jax.Array:
    """Writes new [T, Hkv, D] into pages [Hkv, P, S, D] at flat slots [T]; with ``layer``,
    into layer ``layer`` of a stacked cache [layers, Hkv, P, S, D] (returned whole)."""
    impl = resolve_impl(impl)
    if impl == "reference":
        return kv_write.write_kv(pages, slots, new, layer=layer)
    backend, _, kernel = _KERNELS[impl]
    out = kernel(_layer(pages, layer), slots, new, interpret=jax.default_backend() != backend)
    return out if layer is None else jax.lax.dynamic_update_index_in_dim(pages, out, layer, 0)


__all__ = ["AttentionMetadata", "attention", "write_kv", "resolve_impl", "ATTENTION_IMPLS"]

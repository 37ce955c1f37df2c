"""Attention for a mixed ragged batch over the paged KV cache.

``attention`` is the one call site the model uses; Pallas kernels plug in behind ``impl``.
"""
from __future__ import annotations

import jax

from jserve.kernels.metadata import AttentionMetadata
from jserve.kernels.reference import ragged_paged_attention

ATTENTION_IMPLS = ("reference",)


def attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata,
              impl: str = "reference") -> tuple[jax.Array, jax.Array]:
    """Returns (output [T, Hq, D], log-sum-exp [T, Hq])."""
    if impl == "reference":
        return ragged_paged_attention(q, k_pages, v_pages, meta)
    raise ValueError(f"unknown attention_impl {impl!r}; choose from {ATTENTION_IMPLS}")


__all__ = ["AttentionMetadata", "attention", "ATTENTION_IMPLS"]

"""KV-cache parallelism (``kvp``, Medha-style): a sequence's KV is split by token range over
the ``kvp`` groups, so one very long context is read by every group at once.

Group ``g`` holds tokens ``[g*L, (g+1)*L)`` of every sequence (``L`` = tokens per group, a
multiple of the page size): a short sequence lives only in group 0, a long one spills into
later groups as it grows. Each group has its own page pool (page 0 its sink) and the page
table is laid out in logical page order with group-local page ids: logical page ``j`` covers
tokens ``[j*S, (j+1)*S)`` and belongs to group ``j // (L/S)``, so splitting the table's columns
on ``kvp`` (``sharding.kv_parallel.PAGE_TABLE_SPEC``) hands each group exactly its own
pages.

Queries are replicated over ``kvp``; each group attends to its local keys and the partial
results are merged by their log-sum-exp (online softmax across the axis).

The engine starts each sequence on the least-loaded group ``s`` rather than group 0: group
``g`` then holds its logical chunk ``(g - s) % kvp``, i.e. tokens from ``row_offsets``; the
page table's column block ``g`` holds that chunk's local ids, and ``start_groups`` carries
``s`` per row (see ``jserve/cache/allocator.py`` and ``jserve/engine/batch/builder.py``).

This module is the math of one group, called inside ``jax.shard_map`` with the mesh axis
named by the caller; the mesh specs of the layout are ``sharding/kv_parallel.py``'s.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jserve.kernels import AttentionMetadata, attention, blocks


def owner_group(position, tokens_per_group: int):
    """The group whose pages hold the KV of the token at absolute ``position``."""
    return position // tokens_per_group


def local_kv_len(kv_len, group, tokens_per_group: int):
    """How many of a sequence's ``kv_len`` tokens live in ``group``."""
    return jnp.clip(kv_len - group * tokens_per_group, 0, tokens_per_group)


def local_page_table(page_table, group, pages_per_group: int):
    """Group ``group``'s columns of the logical page table (what ``PAGE_TABLE_SPEC`` gives
    each shard): its local page ids for the sequence's tokens in its range. ``group`` may be
    traced (``axis_index``)."""
    return jax.lax.dynamic_slice_in_dim(page_table, group * pages_per_group, pages_per_group,
                                        axis=1)


def row_offsets(start_groups, group, kvp: int, tokens_per_group: int):
    """First absolute token of each row [S] that ``group`` holds when a row's sequence starts
    in ``start_groups[row]`` (its logical chunk ``(group - start) % kvp`` lives there)."""
    return ((group - start_groups) % kvp) * tokens_per_group


def local_metadata(meta: AttentionMetadata, offsets, tokens_per_group: int) -> AttentionMetadata:
    """``meta`` (global positions and kv_lens, ``page_table`` already the group's columns)
    as the group whose range of each row starts at ``offsets`` (a scalar or per row [S])
    sees it. Shifting the query positions by ``-offset`` keeps causality in local key
    indices: local key j (absolute ``offset + j``) is visible to a query at absolute p iff
    ``j <= p - offset``; queries before the group's range see no key."""
    offsets = jnp.broadcast_to(jnp.asarray(offsets, meta.kv_lens.dtype), meta.kv_lens.shape)
    rows = meta.kv_lens.shape[0]
    token_offsets = offsets[jnp.clip(meta.token_seq, 0, rows - 1)]  # padding: any row's
    kv_lens = jnp.clip(meta.kv_lens - offsets, 0, tokens_per_group)
    # The kernels' query blocking read the global positions: each call makes its own.
    return dataclasses.replace(meta, positions=meta.positions - token_offsets, kv_lens=kv_lens,
                               row_layouts=())


def group_write_slots(positions, token_seq, kv_lens, page_table, group,
                      tokens_per_group: int, page_size: int, offsets=None):
    """Flat local cache slots [T] where ``group`` writes this step's new KV: a live token's
    own slot in the group that owns its position, the sink slot 0 everywhere else (other
    groups' tokens, padding tokens and rows), so every token's KV is stored exactly once.

    ``page_table`` is the group's local table [S, L/S]; token_seq may point past it (padding).
    ``offsets`` [S]: first token of each row's range in this group (``row_offsets``); default
    ``group * L`` (every sequence starting in group 0). The engine computes the same slots on
    the host instead (``StepInput.slot_groups``, ``owned_slots``)."""
    rows = page_table.shape[0]
    seq = jnp.clip(token_seq, 0, rows - 1)
    live = (token_seq < rows) & (positions < kv_lens[seq])
    offset = group * tokens_per_group if offsets is None else jnp.asarray(offsets)[seq]
    local = positions - offset
    mine = live & (local >= 0) & (local < tokens_per_group)
    col = jnp.clip(local // page_size, 0, page_table.shape[1] - 1)
    slot = page_table[seq, col] * page_size + local % page_size
    return jnp.where(mine, slot, 0)


def merge_partials(out, lse, axis: str):
    """Per-group partial attention (out [T, H, D], lse [T, H]) merged over mesh ``axis``."""
    merged, merged_lse = blocks.merge_partials(
        out, lse, lambda x: jax.lax.pmax(x, axis), lambda x: jax.lax.psum(x, axis))
    return merged.astype(out.dtype), merged_lse


def kvp_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata,
                  axis: str = "kvp", impl: str = "reference",
                  start_groups: jax.Array | None = None, layer=None, window=None
                  ) -> tuple[jax.Array, jax.Array]:
    """Ragged paged attention with the KV split by token range over ``axis``; call inside
    ``jax.shard_map`` with q and the metadata replicated over ``axis``, the pages and the page
    table's columns split over it (``sharding.kv_parallel``'s ``KV_PAGES_SPEC`` and
    ``PAGE_TABLE_SPEC``).

    ``start_groups`` [S]: the group holding each row's first tokens (the engine starts a
    sequence on the least-loaded group; its table's column block g then holds its logical
    chunk ``(g - start) % kvp``); None: every row starts in group 0. ``layer``: the pages
    are a stacked cache read at that layer (``jserve.kernels.attention``); ``window`` the
    layer's sliding window, passed on as it is (shifting queries and keys by a group's offset
    keeps p - window < k <= p, so each group skips its own pages before the window; a group
    wholly before it reads nothing and weighs nothing in the merge). The tokens per group
    are implied by the layout: the local table width times the page size. Returns
    (out [T, Hq, D], lse [T, Hq]), replicated over ``axis``."""
    tokens_per_group = meta.page_table.shape[1] * k_pages.shape[-2]
    group = jax.lax.axis_index(axis)
    if start_groups is None:
        offsets = group * tokens_per_group
    else:
        offsets = row_offsets(start_groups, group, jax.lax.axis_size(axis), tokens_per_group)
    out, lse = attention(q, k_pages, v_pages, local_metadata(meta, offsets, tokens_per_group),
                         impl=impl, layer=layer, window=window)
    return merge_partials(out, lse, axis)


def owned_slots(slots, slot_groups, axis: str):
    """This group's write slots: a token's local slot where the group owns it
    (``slot_groups`` from the step builder), the sink slot 0 elsewhere."""
    return jnp.where(slot_groups == jax.lax.axis_index(axis), slots, 0)


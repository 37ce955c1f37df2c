"""KV-cache parallelism (``kvp``) on the mesh: how the KV pages, the page table and the
attention metadata split over the ``kvp`` axis. The layout itself (group ``g`` holds a token
range of every sequence in its own page pool) and the attention of one group are
``jserve/kernels/kv_parallel.py``'s."""
from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from jserve.kernels import AttentionMetadata

KV_PAGES_SPEC = P("tp", "kvp")       # [KV heads, kvp * local pages, page_size, head_dim]
# The engine's stacked cache [layers, KV heads, kvp * local pages, page_size, head_dim]:
# layers split by pipeline stage (a size-1 "spp" axis splits nothing).
STACKED_KV_SPEC = P("spp", "tp", "kvp")
PAGE_TABLE_SPEC = P(None, "kvp")     # [seqs, kvp * local pages per sequence]


def metadata_specs(meta: AttentionMetadata) -> AttentionMetadata:
    """shard_map in_specs for ``meta``: everything replicated but the page table's columns."""
    return dataclasses.replace(meta, positions=P(), token_seq=P(), kv_lens=P(),
                               page_table=PAGE_TABLE_SPEC, num_prefills=P())

"""The attention metadata of one ragged step: the contract between engine and kernels."""
from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Describes a token-flattened batch: ``num_decodes`` single-token decode sequences first,
    then up to ``page_table.shape[0] - num_decodes`` prefill-chunk sequences.

    positions [T]: absolute position of every token. token_seq [T]: owning sequence row
    (padding tokens point at a row with kv_len 0 or beyond ``num_prefills``). kv_lens [S]: the
    sequence's context length including this step's tokens (0 for padding rows).
    page_table [S, max_pages]: page ids of each sequence. num_prefills: live prefill rows
    (a traced scalar, so the count never triggers a compile). row_layouts: the Pallas
    kernels' query blocking (``blocks.RowLayout``s), the same in every layer: a step makes
    them once before its layer loop (``jserve.kernels.with_row_layouts``), else each
    kernel call makes its own (inside the loop on XLA:GPU: six more launches a layer).
    """

    positions: jax.Array
    token_seq: jax.Array
    kv_lens: jax.Array
    page_table: jax.Array
    num_prefills: jax.Array
    num_decodes: int = dataclasses.field(metadata=dict(static=True))
    row_layouts: tuple = ()

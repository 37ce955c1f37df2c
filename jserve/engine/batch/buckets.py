"""Padding buckets: every device dimension takes one of a few sizes, so the step programs
are a small fixed set, all compiled before the engine is ready (``StepPrograms.warmup``), and
a workload of any mix compiles nothing while serving (``tests/test_program_set.py``).

What a step program needs static, and so what is bucketed: the decode rows (the kernels
take ``AttentionMetadata.num_decodes`` as a static split: decodes and prefill chunks are
separate launches), the prefill tokens after them, and from those the sequence rows (decode
rows plus ``prefill_rows`` when there is a prefill: sampling and attention metadata); the
page-table width is one size. Two families, each one ladder:

- decode-only steps (the steady state of serving): 1, 2, 4, 8 rows, then 4x up to the most
  decodes. On CPU a 1-row step is a matrix-vector product, about twice as fast as 4 rows.
- steps with prefill tokens: the prefill tokens on a ladder (``ladder_factor``: 16, 64,
  256, ... on an accelerator; 16, 32, 64, ... on a CPU), with either no decode rows or all
  of them. A padded decode row costs its token's forward only (its attention is skipped:
  its context length is 0), a small share of a step that carries a prefill chunk, so a
  finer grid of decode rows would buy little and cost a program each.

The default engine (32 sequences, 256-token budget) has 6 + 2 x 3 = 12 step shapes on an
accelerator, 6 + 2 x 5 = 16 on a CPU (docs/startup.md)."""
from __future__ import annotations

import bisect
import dataclasses

from jserve.kernels.reference import PAGES_PER_BLOCK

LADDER_FACTOR = 4


def ladder_factor(platform: str) -> int:
    """How the prefill-token sizes grow on ``platform``. A CPU's step costs the compute of
    every padded token (a 128-token prompt padded to 256 took as long as 256 tokens: 0.24-0.27
    s on the 12-layer bench checkpoint of ``scripts/bench_vs_vllm.py``, 64 tokens 0.08 s), so
    its sizes double; an accelerator's step at these sizes is bound by launches and bytes
    more than by tokens, and 4x keeps its program set small."""
    return 2 if platform == "cpu" else LADDER_FACTOR


def _ladder(lo: int, hi: int, factor: int = LADDER_FACTOR) -> tuple[int, ...]:
    """lo, lo * factor, ... below hi, then hi."""
    sizes = set()
    n = lo
    while n < hi:
        sizes.add(n)
        n *= factor
    sizes.add(hi)
    return tuple(sorted(sizes))


@dataclasses.dataclass(frozen=True)
class Buckets:
    decode_rows: tuple[int, ...]      # decode rows of a step with prefill tokens (0 included)
    prefill_tokens: tuple[int, ...]   # sizes for the number of prefill tokens (0 included)
    prefill_rows: int                 # prefill sequence rows when there is any prefill
    page_table_width: int             # pages per sequence row (max_model_len / page_size, padded)
    kvp: int = 1                      # KV-cache-parallel groups: the width is kvp equal blocks
    # Sizes for steps with no prefill tokens (decodes only); empty: ``decode_rows``.
    decode_only_rows: tuple[int, ...] = ()

    @property
    def pages_per_group(self) -> int:
        """Pages of a sequence each kvp group holds (its block of the page table)."""
        return self.page_table_width // self.kvp

    @classmethod
    def for_limits(cls, *, max_num_seqs: int, token_budget: int, max_prefill_seqs: int,
                   max_model_len: int, page_size: int,
                   pages_per_block: int = PAGES_PER_BLOCK, kvp: int = 1,
                   draft_tokens: int = 0, factor: int = LADDER_FACTOR) -> "Buckets":
        """``draft_tokens``: speculative decoding's k, each decode then takes up to 1 + k
        decode rows; ``factor``: the prefill-token ladder's (``ladder_factor``)."""
        # Each group's block of the table is padded like a whole table, so the kernels read
        # it (and L = its width x page_size tokens per group) on every group alike.
        pages_per_seq = -(-max_model_len // page_size)
        pages = -(-pages_per_seq // kvp)
        block = min(pages_per_block, 1 << (pages - 1).bit_length())
        width = -(-pages // block) * block
        decodes = min(max_num_seqs * (1 + draft_tokens), token_budget)
        return cls(
            decode_rows=(0, decodes),  # a step with prefill tokens: no decodes, or all
            prefill_tokens=(0,) + _ladder(min(16, token_budget), token_budget, factor),
            prefill_rows=max_prefill_seqs,
            page_table_width=width * kvp,
            kvp=kvp,
            # 1, 2, 4, 8 rows, then the mixed steps' sizes: padding matters most for small
            # batches. With drafts also 1 + k: one speculating decode alone (batch 1, where
            # latency is what speculation buys) is not padded to the next power of two.
            decode_only_rows=tuple(sorted(set(_ladder(1, min(8, decodes), 2))
                                          | set(_ladder(min(4, decodes), decodes))
                                          | ({min(1 + draft_tokens, decodes)}
                                             if draft_tokens else set()))),
        )

    @property
    def max_rows(self) -> int:
        """Sequence rows of the largest step: what the one sampling program is padded to."""
        return self.decode_rows[-1] + self.prefill_rows

    @staticmethod
    def fit(sizes: tuple[int, ...], n: int) -> int:
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
        return sizes[i]

    def shape_for(self, num_decodes: int, num_prefill_tokens: int) -> tuple[int, int]:
        if num_prefill_tokens == 0 and self.decode_only_rows:
            return self.fit(self.decode_only_rows, num_decodes), 0
        return (self.fit(self.decode_rows, num_decodes),
                self.fit(self.prefill_tokens, num_prefill_tokens))

    def covering(self, shapes) -> tuple[int, int]:
        """The smallest step shape at least each of ``shapes`` (bucket shapes) in both
        dimensions: a pipeline tick's, which runs every batch in the pipeline."""
        shapes = list(shapes)
        return self.shape_for(max((d for d, _ in shapes), default=0),
                              max((p for _, p in shapes), default=0))

    def all_shapes(self) -> list[tuple[int, int]]:
        shapes = [(d, p) for d in self.decode_rows for p in self.prefill_tokens if d or p]
        if not self.decode_only_rows:
            return shapes
        return [(d, 0) for d in self.decode_only_rows] + [s for s in shapes if s[1]]

"""Prompt-lookup (n-gram) proposals on the host: the draft for a sequence is what followed the
latest earlier occurrence of its last n tokens (largest n first), k tokens of it. Output that
quotes its context (document QA, code edits, counting) is copied k tokens a step.

Each sequence keeps an index (``NgramIndex``): for every n, the latest position each n-gram
ended at. A step adds only the tokens appended since the last one and looks up n_max keys,
so a proposal costs microseconds whatever the context length; rescanning the whole history
every step (one numpy pass over the padded batch, the first version) cost about 0.15 ms for
one 200-token sequence on this CPU, a tenth of a decode step of the tiny model, and grows
with the context (docs/speculative.md, the profile).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class NgramIndex:
    """One sequence's tokens and, for each n in [n_min, n_max], the latest end position of
    every n-gram among them that ends before the last token (the suffix itself is never its
    own match)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]
        self._indexed = 0  # n-grams ending at positions < this are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends ``tokens`` (the sequence's new tokens since the last call)."""
        self.tokens.extend(int(t) for t in tokens)

    def propose(self, k: int) -> np.ndarray:
        """Up to ``k`` draft tokens (empty: no n-gram of the suffix with n_min <= n <= n_max
        occurred before). A continuation that runs into the suffix is copied with overlap
        (as LZ77 does), so a repeating pattern is drafted k tokens ahead."""
        toks = self.tokens
        last = len(toks) - 1
        self._index_up_to(last)
        if k <= 0 or last < 1:
            return np.zeros(0, np.int32)
        for n in range(min(self.n_max, last), self.n_min - 1, -1):
            end = self._ends[n].get(tuple(toks[last - n + 1:]))
            if end is not None:
                run = last - end  # tokens after the match: the copy repeats them
                return np.array([toks[end + 1 + j % run] for j in range(k)], np.int32)
        return np.zeros(0, np.int32)

    def _index_up_to(self, stop: int) -> None:
        """Indexes the n-grams ending at positions ``_indexed`` .. ``stop - 1``."""
        toks = self.tokens
        for end in range(self._indexed, stop):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self._ends[n][tuple(toks[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, stop)


def propose_ngram(histories: Sequence[Sequence[int]], ks: Sequence[int], n_min: int,
                  n_max: int) -> list[np.ndarray]:
    """For each history (prompt and output so far) up to ``ks[i]`` draft tokens: the rule of
    ``NgramIndex.propose`` on a fresh index (the engine keeps one per request instead)."""
    out = []
    for h, k in zip(histories, ks):
        index = NgramIndex(n_min, n_max)
        index.extend(h)
        out.append(index.propose(k))
    return out

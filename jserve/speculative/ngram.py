"""Prompt-lookup (n-gram) proposals on the host: the draft for a sequence is what followed the
latest earlier occurrence of its last n tokens (largest n first), k tokens of it. Output that
quotes its context (document QA, code edits, counting) is copied k tokens a step.

Each sequence keeps an index (``NgramIndex``): for every n, the latest position each n-gram
ended at. A step adds only the tokens appended since the last one and looks up n_max keys,
so a proposal costs microseconds whatever the context length; rescanning the whole history
every step (one numpy pass over the padded batch, the first version) cost about 0.15 ms for
one 200-token sequence on this CPU, a tenth of a decode step of the tiny model, and grows
with the context (docs/notes/speculative.md, the profile).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

# Older positions a proposal indexes at most (new tokens always are): about 2.2 ms of Python
# for 1024 positions and n up to 4 on this CPU (a 32k-token prompt: 4.4 ms for its first
# proposal, then 31 more like it, then 3 µs a proposal).
INDEX_BUDGET = 1024


class NgramIndex:
    """One sequence's tokens and, for each n in [n_min, n_max], the latest end position of
    every n-gram among them that ends before the last token (the suffix itself is never its
    own match).

    ``budget`` bounds the work of one ``propose``: a long prompt's first proposal indexes its
    newest ``budget`` positions (and new tokens are always indexed), and each proposal also
    indexes up to ``budget`` older positions (newest first, so a key keeps its latest
    position). Until the prompt is done
    a match only in its older part is not found yet; the engine's loop never stalls on a
    long document (unbounded: 85 ms for 32k tokens on this CPU). None: no bound."""

    def __init__(self, n_min: int, n_max: int, budget: int | None = None):
        self.n_min, self.n_max, self.budget = n_min, n_max, budget
        self.tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]
        # Positions [_older, _newer) are indexed; [0, _older) is still to do (newest first).
        self._older = self._newer = 0

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
        """Indexes the n-grams ending at positions ``_newer`` .. ``stop - 1`` (all of them
        but, on a first call, at most ``budget``), then up to ``budget`` older ones."""
        if self._newer == 0 and self.budget is not None:
            self._older = self._newer = max(0, stop - self.budget)
        for end in range(self._newer, stop):
            self._add(end, overwrite=True)
        self._newer = max(self._newer, stop)
        lo = 0 if self.budget is None else max(0, self._older - self.budget)
        for end in range(self._older - 1, lo - 1, -1):
            self._add(end, overwrite=False)  # a newer position of the key stays
        self._older = lo

    def _add(self, end: int, overwrite: bool) -> None:
        toks = self.tokens
        for n in range(self.n_min, min(self.n_max, end + 1) + 1):
            key = tuple(toks[end - n + 1:end + 1])
            if overwrite:
                self._ends[n][key] = end
            else:
                self._ends[n].setdefault(key, end)


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

"""Prompt-lookup (n-gram) proposals, on the host, vectorised over the batch with numpy: the
draft for a sequence is what followed the latest earlier occurrence of its last n tokens
(largest n first), k tokens of it. Output that quotes its context (document QA, code edits,
counting) is copied k tokens a step."""
from __future__ import annotations

from typing import Sequence

import numpy as np

_PAD = -2  # never a token id (nor the async placeholder, -1)


def propose_ngram(histories: Sequence[np.ndarray], ks: Sequence[int], n_min: int, n_max: int
                  ) -> list[np.ndarray]:
    """For each history (int array: prompt and output so far) up to ``ks[i]`` draft tokens
    (empty when no n-gram of its suffix with ``n_min <= n <= n_max`` occurred before).

    One pass for every n: ``length[b, j]`` counts how many tokens ending at position j
    match the suffix ending at the last token (up to ``n_max``), built from ``n_max``
    shifted comparisons of the whole padded batch; the longest match wins, the latest
    among equals."""
    b = len(histories)
    out = [np.zeros(0, np.int32)] * b
    if b == 0:
        return out
    lens = np.array([len(h) for h in histories])
    width = int(lens.max())
    if width < 2:
        return out
    tokens = np.full((b, width), _PAD, np.int64)
    for i, h in enumerate(histories):
        tokens[i, :len(h)] = h
    rows = np.arange(b)
    run = np.arange(width)[None, :] < (lens - 1)[:, None]  # a match must end before the last
    length = np.zeros((b, width), np.int32)
    for i in range(min(n_max, width - 1)):
        target = np.where(lens - 1 - i >= 0, tokens[rows, np.maximum(lens - 1 - i, 0)], _PAD)
        run[:, i:] &= tokens[:, :width - i] == target[:, None]
        run[:, :i] = False
        length += run
    length[length < n_min] = 0
    best = length.max(1)
    best[np.asarray(ks) <= 0] = 0
    end = width - 1 - np.argmax((length == best[:, None])[:, ::-1], 1)
    for i in np.flatnonzero(best > 0):
        # Copied with overlap (as LZ77 does): a continuation that runs into the suffix
        # goes on with the draft itself, so a repeating pattern is drafted k tokens ahead.
        seq = tokens[i, end[i] + 1:lens[i]]
        out[i] = seq[np.arange(ks[i]) % len(seq)].astype(np.int32)
    return out

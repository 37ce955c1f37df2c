"""Prompt-lookup (n-gram) proposals, on the host, vectorised over the batch with numpy: the
draft for a sequence is what followed the latest earlier occurrence of its last n tokens
(largest n first), k tokens of it. Output that quotes its context (document QA, code edits,
counting) is copied k tokens a step."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_PAD = -2  # never a token id (nor the async placeholder, -1)


def propose_ngram(histories: Sequence[np.ndarray], ks: Sequence[int], n_min: int, n_max: int
                  ) -> list[np.ndarray]:
    """For each history (int array: prompt and output so far) up to ``ks[i]`` draft tokens
    (empty when no n-gram of its suffix with ``n_min <= n <= n_max`` occurred before)."""
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
    ks = np.asarray(ks)
    found = np.full(b, -1)  # where the draft starts in the history
    rows = np.arange(b)
    for n in range(min(n_max, width - 1), n_min - 1, -1):
        todo = (found < 0) & (lens > n) & (ks > 0)
        if not todo.any():
            break
        idx = rows[todo]
        t, ln = tokens[idx], lens[idx]
        suffix = t[np.arange(len(idx))[:, None], ln[:, None] - n + np.arange(n)]
        windows = sliding_window_view(t, n, axis=1)  # [rows, width - n + 1, n]
        match = (windows == suffix[:, None, :]).all(-1)
        # Only occurrences that end before the suffix's last token, so a continuation exists.
        starts = np.arange(windows.shape[1])
        match &= starts[None, :] + n < ln[:, None]
        last = np.where(match.any(1), windows.shape[1] - 1 - np.argmax(match[:, ::-1], 1), -1)
        found[idx] = np.where(last >= 0, last + n, -1)
    for i in np.flatnonzero(found >= 0):
        # Copied with overlap (as LZ77 does): a continuation that runs into the suffix
        # goes on with the draft itself, so a repeating pattern is drafted k tokens ahead.
        s, period = found[i], lens[i] - found[i]
        seq = tokens[i, s:lens[i]]
        out[i] = seq[np.arange(ks[i]) % period].astype(np.int32)
    return out

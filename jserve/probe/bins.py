"""Remaining-length bins: finite edges plus one overflow bin for everything past the last edge.

Widths and centres are computed once per bins object (the filter reads them every step).
The filter needs every bin's width (a bin of width w is left after about w generated tokens)
and centre (what the bin stands for in the expected value); the overflow bin has no upper
end, so it borrows the last finite bin's width and sits half a width past the last edge.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)  # cached on the bins object: callers must not change it
    return a


@dataclasses.dataclass(frozen=True)
class LengthBins:
    edges: tuple[float, ...]  # increasing, edges[0] == 0; bin b is [edges[b], edges[b+1])

    def __post_init__(self) -> None:
        e = np.asarray(self.edges, float)
        if e.ndim != 1 or len(e) < 2:
            raise ValueError(f"need at least two bin edges, got {self.edges!r}")
        if e[0] != 0 or not np.all(np.diff(e) > 0):
            raise ValueError(f"bin edges must start at 0 and increase, got {self.edges!r}")

    @classmethod
    def equal(cls, num_bins: int = 10, max_len: float = 512) -> "LengthBins":
        """``num_bins`` equal bins over [0, max_len) plus the overflow bin."""
        if num_bins < 1 or not max_len > 0:
            raise ValueError(f"need num_bins >= 1 and max_len > 0, got {num_bins}, {max_len}")
        return cls(tuple(np.linspace(0.0, max_len, num_bins + 1).tolist()))

    @classmethod
    def log_spaced(cls, num_bins: int = 10, max_len: float = 512) -> "LengthBins":
        """[0, 1), then ``num_bins - 1`` geometrically growing bins up to max_len, plus the
        overflow bin: fine resolution where short requests need it."""
        if num_bins < 2 or not max_len > 1:
            raise ValueError(f"need num_bins >= 2 and max_len > 1, got {num_bins}, {max_len}")
        return cls((0.0,) + tuple(np.geomspace(1.0, max_len, num_bins).tolist()))

    @property
    def num_bins(self) -> int:
        """Finite bins plus the overflow bin."""
        return len(self.edges)

    @functools.cached_property
    def widths(self) -> np.ndarray:
        w = np.diff(np.asarray(self.edges, float))
        return _frozen(np.append(w, w[-1]))

    @functools.cached_property
    def centres(self) -> np.ndarray:
        e = np.asarray(self.edges, float)
        return _frozen(np.append((e[:-1] + e[1:]) / 2, e[-1] + self.widths[-1] / 2))

    def bin_of(self, lengths) -> np.ndarray:
        """Bin index of each length (>= 0); past the last edge is the overflow bin."""
        x = np.asarray(lengths, float)
        if np.any(x < 0):
            raise ValueError("lengths must be >= 0")
        return np.searchsorted(np.asarray(self.edges, float), x, side="right") - 1

    def expected(self, probs) -> np.ndarray:
        """Expected remaining length of bin distributions [..., num_bins]."""
        return np.asarray(probs, float) @ self.centres

"""The Bayesian filter over remaining-length bins (TRAIL).

Between two predictions one token is generated, so a request in bin b stays there with
probability 1 - 1/w_b and moves one bin down with probability 1/w_b (bin 0 stays). The prior
of a step is the previous posterior pushed through that transition; the posterior is the prior
times the probe's softmax, renormalised; the prediction is its expected length.
"""
from __future__ import annotations

import numpy as np

from jserve.probe.bins import LengthBins


def transition_matrix(bins: LengthBins) -> np.ndarray:
    """T[i, j] = P(bin j after one token | bin i now); rows sum to 1."""
    n = bins.num_bins
    down = np.minimum(1.0 / bins.widths, 1.0)
    down[0] = 0.0
    t = np.diag(1.0 - down)
    t[np.arange(1, n), np.arange(n - 1)] = down[1:]
    return t


def posterior(prev: np.ndarray, likelihood: np.ndarray, transition: np.ndarray) -> np.ndarray:
    """One filter step: (prev @ T) * likelihood, normalised. Falls back to the likelihood
    alone if the product vanishes (the probe contradicts everything the prior allows).
    Row-wise on stacked [n, bins] inputs, so the engine filters a whole step at once."""
    lik = np.asarray(likelihood, float)
    post = (np.asarray(prev, float) @ transition) * lik
    total = post.sum(axis=-1, keepdims=True)
    vanished = ~(total > 0)
    post = np.where(vanished, lik, post)
    total = np.where(vanished, lik.sum(axis=-1, keepdims=True), total)
    return post / total


class RemainingFilter:
    """One request's running estimate: ``start`` with the prompt-only probabilities, then
    ``update`` with each generated token's probe output."""

    def __init__(self, bins: LengthBins, transition: np.ndarray | None = None):
        self.bins = bins
        self.transition = transition if transition is not None else transition_matrix(bins)
        self.probs: np.ndarray | None = None

    def start(self, probs: np.ndarray) -> float:
        self.probs = np.asarray(probs, float) / np.sum(probs)
        return self.expected

    def update(self, likelihood: np.ndarray) -> float:
        if self.probs is None:
            raise ValueError("update before start: the first prediction comes from the prompt")
        self.probs = posterior(self.probs, likelihood, self.transition)
        return self.expected

    @property
    def expected(self) -> float:
        return float(self.bins.expected(self.probs))

"""A synthetic document task whose answer quotes the prompt: ``quote: PASSAGE`` -> ``PASSAGE``.

The workload speculative decoding is for (document QA, summaries that quote, code edits):
the output copies its context. The model that learns it (``scripts/train_quote_model.py``,
tiny-tasks fine-tuned) gives ``scripts/bench_speculative.py`` a real model whose answers
copy the document, which neither the random model nor tiny-tasks does. Passages are random
words, so nothing but the copy predicts them.
"""
from __future__ import annotations

import numpy as np

from jserve.train.length_task import Task

WORDS = ("the", "report", "says", "that", "river", "north", "budget", "was", "approved",
         "by", "council", "after", "a", "long", "meeting", "on", "tuesday", "library",
         "new", "wing", "will", "open", "in", "spring", "and", "cost", "less", "than",
         "planned", "school", "bridge", "road", "green", "park", "old", "station", "city",
         "water", "price", "market")
MIN_WORDS, MAX_WORDS = 8, 40


def quote(passage: str) -> Task:
    return Task(f"quote: {passage}", passage, "quote")


def sample_quote(rng: np.random.Generator, split: str = "all") -> Task:
    """A passage of ``MIN_WORDS``-``MAX_WORDS`` random words (``split`` is accepted for the
    trainer's ``sample(rng, split)``; passages are drawn fresh, so none repeats)."""
    n = int(rng.integers(MIN_WORDS, MAX_WORDS + 1))
    return quote(" ".join(WORDS[i] for i in rng.integers(len(WORDS), size=n)))

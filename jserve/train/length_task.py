"""A synthetic instruction task whose answer length the prompt determines.

Every kind has a stopping rule a ~1M-parameter byte-level model can learn from local context
(the last number written, the item count, the end of the copied text), so the model has to
learn *when* to emit EOS and its hidden state at the end of the prompt carries the answer
length: what an output-length probe reads. Answers span 1-483 bytes, so the probe's
default bins (10 equal bins over 0-512) are all used.
"""
from __future__ import annotations

import dataclasses

import numpy as np

FRUITS = ("apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum")
WORDS = ("red", "blue", "cat", "dog", "sun", "moon", "tree", "fish", "star", "rain", "bird",
         "hill", "lake", "wind", "rock", "leaf")
KINDS = ("count_up", "count_down", "list_fruits", "copy")
MAX_COUNT = 148    # "count to 148" is 483 bytes: reaches the probe's last bin (>= 460.8)
MAX_ITEMS = 40     # "list 40 fruits" is 397 bytes
MAX_COPY_WORDS = 16


@dataclasses.dataclass(frozen=True)
class Task:
    prompt: str   # the instruction; the model sees format_prompt(prompt)
    answer: str   # the exact completion (the model then emits EOS)
    kind: str


def format_prompt(prompt: str) -> str:
    """The text the model was trained on before the answer (the tokenizer adds BOS)."""
    return prompt + "\n"


def count_up(n: int) -> Task:
    return Task(f"count to {n}", " ".join(str(i) for i in range(1, n + 1)), "count_up")


def count_down(n: int) -> Task:
    return Task(f"count down from {n}", " ".join(str(i) for i in range(n, 0, -1)), "count_down")


def list_fruits(n: int) -> Task:
    """Numbered items cycling through FRUITS in a fixed order."""
    items = [f"{i}. {FRUITS[(i - 1) % len(FRUITS)]}" for i in range(1, n + 1)]
    return Task(f"list {n} fruits", "\n".join(items), "list_fruits")


def copy_text(words: list[str]) -> Task:
    text = " ".join(words)
    return Task(f"copy: {text}", text, "copy")


def sample_task(rng: np.random.Generator) -> Task:
    kind = KINDS[rng.integers(len(KINDS))]
    if kind == "count_up":
        return count_up(int(rng.integers(1, MAX_COUNT + 1)))
    if kind == "count_down":
        return count_down(int(rng.integers(1, MAX_COUNT + 1)))
    if kind == "list_fruits":
        return list_fruits(int(rng.integers(1, MAX_ITEMS + 1)))
    n = int(rng.integers(1, MAX_COPY_WORDS + 1))
    return copy_text([WORDS[i] for i in rng.integers(len(WORDS), size=n)])


def sample_tasks(n: int, seed: int) -> list[Task]:
    """``n`` tasks drawn with ``seed``: the same list for the same arguments everywhere."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    return [sample_task(rng) for _ in range(n)]

"""A synthetic instruction task whose answer length the prompt determines.

Both kinds count down to 1, so the stopping rule is local (EOS right after the item numbered
1) and a ~1M-parameter byte-level model learns it in a few hundred CPU steps; the prompt's N
fixes the answer length, which the model's hidden state therefore carries: what an
output-length probe reads. Answers span 1-483 bytes, so each of the probe's default bins
(10 equal bins over 0-512) is used.

Narrowed from a first mix that also had "count to N" and "copy: TEXT": within the training
budget the model never learned to stop those (stopping there needs comparing the last number
written with the prompt's N, or an induction copy), so they ran to max_tokens.
"""
from __future__ import annotations

import dataclasses

import numpy as np

FRUITS = ("apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum")
KINDS = ("count_down", "list_fruits")
SPLITS = ("all", "train", "test")
MAX_COUNT = 148    # "count down from 148" is 483 bytes: reaches the probe's last bin (>= 460.8)
MAX_ITEMS = 48     # "list 48 fruits" is 476 bytes


@dataclasses.dataclass(frozen=True)
class Task:
    prompt: str   # the instruction; the model sees format_prompt(prompt)
    answer: str   # the exact completion (the model then emits EOS)
    kind: str


def format_prompt(prompt: str) -> str:
    """The text the model was trained on before the answer (the tokenizer adds BOS)."""
    return prompt + "\n"


def count_down(n: int) -> Task:
    """"N N-1 ... 1"."""
    return Task(f"count down from {n}", " ".join(str(i) for i in range(n, 0, -1)), "count_down")


def list_fruits(n: int) -> Task:
    """N lines numbered N down to 1; the fruits cycle through FRUITS from the first line."""
    items = [f"{n - k}. {FRUITS[k % len(FRUITS)]}" for k in range(n)]
    return Task(f"list {n} fruits", "\n".join(items), "list_fruits")


def is_held_out(n: int) -> bool:
    """Every 11th count (5, 16, 27, ...) is never trained on, so the "test" split measures
    generalisation to unseen lengths rather than recall of seen answers. (Every last digit
    still occurs in training prompts: holding out all counts ending in 7 left the model
    unable to copy a final 7 from the prompt.)"""
    return n % 11 == 5


def _draw_n(rng: np.random.Generator, top: int, split: str) -> int:
    if split == "all":
        return int(rng.integers(1, top + 1))
    ns = [n for n in range(1, top + 1) if is_held_out(n) == (split == "test")]
    return int(ns[rng.integers(len(ns))])


def sample_task(rng: np.random.Generator, split: str = "all") -> Task:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if KINDS[rng.integers(len(KINDS))] == "count_down":
        return count_down(_draw_n(rng, MAX_COUNT, split))
    return list_fruits(_draw_n(rng, MAX_ITEMS, split))


def sample_tasks(n: int, seed: int, split: str = "all") -> list[Task]:
    """``n`` tasks drawn with ``seed``: the same list for the same arguments everywhere.

    ``split``: "all" (every N), "train" (N not held out: what the model was trained on) or
    "test" (held-out N only, see :func:`is_held_out`)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    return [sample_task(rng, split) for _ in range(n)]

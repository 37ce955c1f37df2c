"""Token sequences that only know their length: what the simulator passes as a Request's
``prompt_token_ids`` and ``token_ids`` so that a 1M-token prompt costs O(1) memory.

Schedulers only ask a request's sequences for their length, slice them (``output_token_ids``)
and append sampled tokens; every token reads as id 0. For prefix caching a sequence may carry
a prefix identity instead of ids: its first ``prefix_tokens`` tokens are those of the shared
document ``prefix_id`` and the rest are its ``owner``'s own, which is all the page keys
(``page_key``) need.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Iterator


class LengthOnlyTokens:
    __slots__ = ("_n", "_prefix", "_owner")

    def __init__(self, n: int = 0, *, prefix: tuple[str, int] | None = None,
                 owner: str | None = None):
        if n < 0:
            raise ValueError(f"length must be >= 0, got {n}")
        self._n = n
        self._prefix = prefix  # (shared document id, its tokens at the start)
        self._owner = owner

    def page_key(self, j: int, page_size: int) -> tuple:
        """Content key of full page ``j`` (``jserve.cache.prefix``): a page wholly inside the
        shared document is keyed by the document; any other by its owner (never shared)."""
        if self._prefix is not None and (j + 1) * page_size <= self._prefix[1]:
            return ("doc", self._prefix[0], page_size, j)
        return ("own", self._owner, page_size, j)

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def append(self, token: int) -> None:
        self._n += 1

    def extend(self, tokens: Iterable[int]) -> None:
        self._n += len(tokens) if hasattr(tokens, "__len__") else sum(1 for _ in tokens)

    def __getitem__(self, index: int | slice) -> "int | LengthOnlyTokens":
        if isinstance(index, slice):
            return LengthOnlyTokens(len(range(self._n)[index]))  # O(1): ranges slice lazily
        range(self._n)[index]  # raises IndexError out of range
        return 0

    def __iter__(self) -> Iterator[int]:
        return itertools.repeat(0, self._n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LengthOnlyTokens):
            return self._n == other._n
        return NotImplemented

    def __repr__(self) -> str:
        return f"LengthOnlyTokens({self._n})"

"""Content keys of full KV pages, what automatic prefix caching indexes pages by.

A page's key is (digest of everything before it, its own token ids): two pages have the same
key only if their sequences agree on every token up to the end of the page, so a cached page
is only ever shared between requests whose token ids are identical up to it. The digest
chains a 128-bit BLAKE2b over the previous page's key (a collision is as unlikely as in
vLLM's SHA-256 chain); the page's own ids are kept in the key and compared exactly.

Sequences that only know their length (the simulator's ``LengthOnlyTokens``) supply keys
from their prefix identity instead (``page_key``), so a million-token document costs O(1).
"""
from __future__ import annotations

import hashlib
from typing import Hashable, Sequence

import numpy as np

PageKey = Hashable
_ROOT = b"jserve-prefix-v1"


def _digest(parent: PageKey | None, salt: str | None = None) -> bytes:
    if parent is None:
        return _ROOT if salt is None else hashlib.blake2b(
            _ROOT + salt.encode(), digest_size=16).digest()
    parent_digest, ids = parent
    h = hashlib.blake2b(parent_digest, digest_size=16)
    h.update(np.asarray(ids, np.int32).tobytes())
    return h.digest()


def extend_page_keys(keys: list[PageKey], tokens: Sequence[int], page_size: int,
                     num_pages: int, salt: str | None = None) -> list[PageKey]:
    """Grows ``keys`` (a sequence's keys so far, in place) to its first ``num_pages`` full
    pages of ``tokens`` and returns it. ``salt`` (a LoRA adapter's name) starts the chain
    from another root: the same tokens under two salts share no key."""
    num_pages = min(num_pages, len(tokens) // page_size)
    page_key = getattr(tokens, "page_key", None)
    for j in range(len(keys), num_pages):
        if page_key is not None:
            keys.append(page_key(j, page_size))
            continue
        ids = tuple(tokens[j * page_size:(j + 1) * page_size])
        keys.append((_digest(keys[-1] if keys else None, salt), ids))
    return keys

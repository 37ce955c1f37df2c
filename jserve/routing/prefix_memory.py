"""Where a router sent which prompts, as a guess of what each replica's prefix cache holds:
for routers that see only periodic reports (Ray Serve's routing stats), not a per-request
lookup (``/v1/route/wait``). Prompts are cut into pages of ``page_size`` token ids, each keyed
by its whole prefix (``jserve.cache.prefix``), so a hit means the same leading tokens; each
replica remembers its most recent ``capacity`` pages (least recently used go first)."""
from __future__ import annotations

import collections
from typing import Hashable, Sequence

from jserve.cache.prefix import extend_page_keys


class PrefixMemory:
    def __init__(self, page_size: int = 16, capacity: int = 65_536):
        if page_size < 1 or capacity < 1:
            raise ValueError("page_size and capacity must be >= 1")
        self.page_size, self.capacity = page_size, capacity
        self._pages: dict[Hashable, collections.OrderedDict] = {}

    def _keys(self, token_ids: Sequence[int]) -> list:
        return extend_page_keys([], token_ids, self.page_size,
                                max(len(token_ids) - 1, 0) // self.page_size)

    def cached_tokens(self, replica: Hashable, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` in pages last sent to ``replica``."""
        pages = self._pages.get(replica)
        if not pages:
            return 0
        n = 0
        for key in self._keys(token_ids):
            if key not in pages:
                break
            n += 1
        return n * self.page_size

    def record(self, replica: Hashable, token_ids: Sequence[int]) -> None:
        """``token_ids`` went to ``replica``: its pages are (about to be) cached there."""
        pages = self._pages.setdefault(replica, collections.OrderedDict())
        for key in self._keys(token_ids):
            pages[key] = None
            pages.move_to_end(key)
        while len(pages) > self.capacity:
            pages.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica gone: nothing of it is cached any more."""
        self._pages.pop(replica, None)

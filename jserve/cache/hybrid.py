"""Two KV layer groups for a model with windowed and full-attention layers (Gemma 3).

A page id holds KV for every layer of one stacked array, so a model with any full-attention
layer keeps every page of a request. Here the layers are split into two groups, each with
its own stacked KV arrays and page pool (``jserve.cache.pool.HybridKV``): the global
(full-attention) layers keep every page, the local (windowed) layers give back the pages
their window has passed, as a model windowed everywhere does (``PageAllocator.drop_dead``).
A long request then holds global layers x all pages + local layers x about one window.

The scheduler stays group-blind: one logical page of a request is one int, the pair
``global + local * global_pool`` (``HybridAllocator.pack``), whose local part becomes 0 (the
local sink) when the window passes it. Every step, ``StepBuilder`` splits the ids into the
two page tables and slot arrays the layers read (``jserve.model.decoder.step_layer``).
"""
from __future__ import annotations

from typing import Hashable, Sequence

from jserve.cache.allocator import PageAllocator, held_pages
from jserve.config import ModelConfig


def local_window(cfg: ModelConfig) -> int | None:
    """The window of the windowed layers when some layers are windowed and some are not
    (the two-group case), else None."""
    windows = cfg.layer_windows
    if any(windows) and not all(windows):
        return max(windows)
    return None


def group_layers(cfg: ModelConfig) -> tuple[tuple[bool, int], ...]:
    """For each model layer: (local?, its index in its group's stacked KV arrays)."""
    seen = [0, 0]
    out = []
    for w in cfg.layer_windows:
        local = bool(w)
        out.append((local, seen[local]))
        seen[local] += 1
    return tuple(out)


def split_pages(layer_pages: int, num_global: int, num_local: int, useful_global: int,
                useful_local: int) -> tuple[int, int]:
    """(global pool, local pool) in pages, sink included, from a budget of ``layer_pages``
    (one page of one layer each): every group gets the same fraction of what it can ever
    use (``useful_*``: every sequence slot at full context holds that many pages of the
    group), at most all of it; what a page of either group costs is its layer count."""
    avail = layer_pages - num_global - num_local  # the two sinks
    need = useful_global * num_global + useful_local * num_local
    if avail >= need:
        return useful_global + 1, useful_local + 1
    share = max(avail, 0) / need
    return int(share * useful_global) + 1, int(share * useful_local) + 1


def request_layer_pages(cfg: ModelConfig, num_tokens: int, page_size: int,
                        max_chunk: int, hybrid: bool) -> int:
    """Layer-pages (one page of one layer) a request of ``num_tokens`` holds at most: every
    layer x all its pages, or with the two groups global layers x all + local layers x the
    window's (``held_pages``)."""
    pages = -(-num_tokens // page_size)
    window = local_window(cfg)
    if not hybrid or window is None:
        return cfg.num_hidden_layers * pages
    num_local = sum(1 for w in cfg.layer_windows if w)
    return ((cfg.num_hidden_layers - num_local) * pages
            + num_local * held_pages(num_tokens, page_size, window, max_chunk))


class HybridAllocator(PageAllocator):
    """The global group's allocator (what it inherits: counts, ``total``, the prefix cache
    of the global pages) holding the local group's (``local``, windowed) beside it. Every
    method that takes or gives page ids speaks packed ids (``pack``): each logical page takes
    one page of each group, a lookup finds a prefix only where both groups cached it."""

    def __init__(self, num_pages: int, local_pages: int, page_size: int, window: int, *,
                 prefix_caching: bool = False, max_chunk: int = 1):
        super().__init__(num_pages, page_size, prefix_caching=prefix_caching,
                         max_chunk=max_chunk)
        self.local = PageAllocator(local_pages, page_size, prefix_caching=prefix_caching,
                                   window=window, max_chunk=max_chunk)
        self.local_window = window

    def blank(self) -> HybridAllocator:
        return HybridAllocator(self.pool_pages, self.local.pool_pages, self.page_size,
                               self.local_window, prefix_caching=self.prefix_caching,
                               max_chunk=self.max_chunk)

    frees_dead = True  # the scheduler calls ``drop_dead`` (which drops local halves only)

    def pack(self, glob: int, loc: int) -> int:
        return glob + loc * self.pool_pages

    def split(self, pages: Sequence[int]) -> tuple[list[int], list[int]]:
        """(global ids, local ids) of packed ``pages`` (a dropped local half is 0)."""
        n = self.pool_pages
        return [b % n for b in pages], [b // n for b in pages]

    def dead_pages(self, position: int) -> int:
        """No entry of a page list becomes a sink: the global half is always held."""
        return 0

    def can_extend(self, page_ids: Sequence[int], n: int) -> bool:
        return n <= self.num_free_in(0) and n <= self.local.num_free_in(0)

    def extendable(self, page_ids: Sequence[int]) -> int:
        return min(self.num_free_in(0), self.local.num_free_in(0))

    def extend(self, page_ids: Sequence[int], n: int) -> list[int]:
        if not self.can_extend(page_ids, n):
            raise self._out_of_pages(page_ids, n)
        glob = super().extend(page_ids, n)
        return [self.pack(g, b) for g, b in zip(glob, self.local.extend((), n))]

    def _out_of_pages(self, page_ids: Sequence[int], n: int):
        err = super()._out_of_pages(page_ids, n)
        return type(err)(f"{err}; local group free: {self.local.num_free_in(0)}")

    def can_ever_hold(self, num_pages: int) -> bool:
        """Whether empty pools could hold a sequence of ``num_pages`` pages: all of them in
        the global pool, about a window's in the local one."""
        return (num_pages <= self.total and self.local.pages_held(num_pages * self.page_size)
                <= self.local.total)

    def free(self, pages: list[int]) -> None:
        glob, loc = self.split(pages)
        super().free(glob)
        self.local.free([b for b in loc if b])

    def drop_dead(self, page_ids: list[int], dropped: int, position: int) -> int:
        """The local halves of the pages the window has passed at ``position`` go back;
        their entries keep the global half. Returns ``dropped`` unchanged: no entry stops
        being held. Unlike a model windowed everywhere (``PageAllocator.drop_dead``), a
        cached local page stays cached, idle (evictable, so counted free): ``lookup`` needs
        only the window's pages before a hit, never a prefix's leading ones, so a later
        request sharing a prefix past the window (a system prompt, the next turn) still
        finds its local pages while nothing has needed their memory."""
        n = self.pool_pages
        end = min(self.local.dead_pages(position), len(page_ids))
        start = end
        while start > 0 and page_ids[start - 1] >= n:  # the live halves before ``end``
            start -= 1
        if start < end:
            self.local.free([b // n for b in page_ids[start:end]])
            page_ids[start:end] = [b % n for b in page_ids[start:end]]
        return dropped

    # -- prefix cache ------------------------------------------------------------------
    def lookup(self, keys: Sequence[Hashable]) -> list[int]:
        """The longest cached prefix whose global pages are all cached and whose local pages
        a query after it still reads (the window's) are too; the local halves before those
        are 0 (a claim takes only the global ones)."""
        glob = super().lookup(keys)
        cached = [self.local._page_of.get(k) for k in keys[:len(glob)]]
        missing = -1  # the last index before j whose local page is not cached
        best = 0
        for j in range(1, len(glob) + 1):
            if cached[j - 1] is None:
                missing = j - 1
            if missing < self.local.dead_pages(j * self.page_size):
                best = j
        dead = self.local.dead_pages(best * self.page_size)
        return [g if j < dead else self.pack(g, cached[j]) for j, g in enumerate(glob[:best])]

    def acquire(self, pages: Sequence[int]) -> None:
        glob, loc = self.split(pages)
        super().acquire(glob)
        self.local.acquire([b for b in loc if b])

    def register(self, page: int, key: Hashable) -> None:
        glob, loc = divmod(page, self.pool_pages)[::-1]
        super().register(glob, key)
        if loc:
            self.local.register(loc, key)

    # -- invariants --------------------------------------------------------------------
    def check_holders(self, page_lists: Sequence[Sequence[int]]) -> None:
        split = [self.split(pages) for pages in page_lists]
        super().check_holders([glob for glob, _ in split])
        self.local.check_holders([[b for b in loc if b] for _, loc in split])

    def check(self) -> None:
        """Both pools' conservation invariants (``PageAllocator.check``)."""
        super().check()
        self.local.check()

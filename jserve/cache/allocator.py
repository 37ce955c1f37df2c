"""Host-side KV page allocator (pure Python: the scheduler and simulator use it without JAX).

With ``groups > 1`` (KV-cache parallelism) the pool is split into one pool per kvp group of
``num_pages`` pages each; global page id = ``group * num_pages + local id``, and local id 0
of every group is that group's sink (padding tokens write there), never handed out. A
sequence's logical page ``j`` lives in group ``(start + j // pages_per_group) % groups`` where
``start`` is the group of its first page, chosen as the least-loaded group when the first page
is allocated; so pages are allocated per sequence through ``extend`` (the next pages of a
sequence), and every capacity check asks about the groups those pages go to. ``groups == 1``
is one pool with page 0 as the sink.

Prefix caching (``prefix_caching=True``): a full page whose KV has been computed is
registered under its content key (``jserve.cache.prefix``); pages are reference-counted, so a
new sequence can take the longest cached run of its leading pages (``lookup`` + ``acquire``)
instead of recomputing them. A cached page whose count drops to zero stays cached ("idle") and
is evicted, least recently used first, only when a page is needed and none is free; idle pages
count as available everywhere capacity is asked. Invariant: free + idle + in use == total.

Sliding windows (``window``, the model's ``kv_window``: every layer windowed): a query at
position p reads only keys after p - window, so a running sequence gives back its leading
pages that no later query reads (``drop_dead``) and holds about one window plus one chunk
(``pages_held``). Their entries in its page list become ``FREED_PAGE`` (the sink: the kernels
skip out-of-window pages and never read those entries). One group only: with kvp a
sequence's pages are placed by their logical index from its first page's group, and a
model with some full-attention layer (Gemma 3's global layers: ``kv_window`` None) keeps
every page here; ``jserve.cache.hybrid`` gives such a model a pool per layer group and frees
the windowed layers' pages.
"""
from __future__ import annotations

import collections
from typing import Hashable, Sequence

from jserve.cache.host_tier import HostTier

# What a sequence's page list holds in place of a leading page the window has passed.
FREED_PAGE = 0


class OutOfPages(RuntimeError):
    pass


def held_pages(num_tokens: int, page_size: int, window: int | None = None,
               max_chunk: int = 1) -> int:
    """The most pages a sequence of ``num_tokens`` tokens holds at once: all of them, or
    with a ``window`` (pages dropped as ``PageAllocator.drop_dead`` does) the pages live
    around a step of ``max_chunk`` tokens starting at any offset in a page,
    ceil((window + max_chunk + page_size - 2) / page_size), whichever is fewer. What the
    intake, the memory plan and the pool's cap count a request by."""
    pages = -(-num_tokens // page_size)
    if window is None:
        return pages
    return min(pages, -(-(window + max_chunk + page_size - 2) // page_size))


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, *, groups: int = 1,
                 pages_per_group: int | None = None, prefix_caching: bool = False,
                 window: int | None = None, max_chunk: int = 1):
        """``num_pages`` pages per group (sink included); ``pages_per_group`` logical pages of
        a sequence per group (needed when ``groups > 1``); ``window``: the sliding window a
        sequence's dead pages are dropped by (None: every page is kept), ``max_chunk`` the
        most tokens one step computes for a sequence (what ``pages_held`` adds to it)."""
        if window is not None and (groups > 1 or window < 1):
            raise ValueError(f"a sliding window frees pages with one KV group and a window "
                             f"of at least 1 token; got window={window}, groups={groups}")
        if num_pages < 2:
            raise ValueError(f"need at least 2 KV pages (one is reserved), got {num_pages}")
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        if groups > 1 and (pages_per_group is None or pages_per_group < 1):
            raise ValueError(f"groups={groups} needs pages_per_group >= 1, got {pages_per_group}")
        self.page_size = page_size
        self.groups = groups
        self.pool_pages = num_pages
        self.pages_per_group = pages_per_group if groups > 1 else None
        self.total = groups * (num_pages - 1)
        self._free: list[list[int]] = [
            list(range(g * num_pages + num_pages - 1, g * num_pages, -1)) for g in range(groups)]
        self.prefix_caching = prefix_caching
        self._refs: dict[int, int] = {}  # in-use page -> number of sequences holding it
        # Cached pages: key <-> page, and per group the idle ones (count 0), LRU first.
        self._page_of: dict[Hashable, int] = {}
        self._key_of: dict[int, Hashable] = {}
        self._idle: list[collections.OrderedDict[int, None]] = [
            collections.OrderedDict() for _ in range(groups)]
        self.num_evictions = 0
        self.window = window
        self.max_chunk = max_chunk
        # The host tier (``jserve.cache.host_tier``): evicted cached pages are copied there
        # instead of dropped. None: no tier.
        self.host: HostTier | None = None

    def blank(self) -> PageAllocator:
        """An empty pool of this one's geometry: what intake in another process checks a
        request's pages against (the live pool, and its host tier, stay with the engine)."""
        return PageAllocator(self.pool_pages, self.page_size, groups=self.groups,
                             pages_per_group=self.pages_per_group,
                             prefix_caching=self.prefix_caching, window=self.window,
                             max_chunk=self.max_chunk)

    @property
    def frees_dead(self) -> bool:
        """Whether a running sequence gives back pages its window has passed
        (``drop_dead``; ``jserve.cache.hybrid`` frees the windowed layers' halves)."""
        return self.window is not None

    @property
    def num_free(self) -> int:
        """Pages a sequence could take now: free ones and idle cached ones (evictable)."""
        return sum(map(len, self._free)) + self.num_idle

    @property
    def num_allocated(self) -> int:
        """Pages in use (held by at least one sequence)."""
        return len(self._refs)

    @property
    def num_idle(self) -> int:
        """Cached pages no sequence holds."""
        return sum(map(len, self._idle))

    @property
    def num_cached(self) -> int:
        """Pages registered in the prefix cache, in use or idle."""
        return len(self._key_of)

    @property
    def tokens_per_group(self) -> int | None:
        """Tokens of a sequence each group holds (None: one group, no boundary)."""
        return None if self.pages_per_group is None else self.pages_per_group * self.page_size

    def free_pages(self) -> list[int]:
        """Pages on the free lists: held by no sequence and not cached."""
        return [b for free in self._free for b in free]

    def num_free_in(self, group: int) -> int:
        return len(self._free[group]) + len(self._idle[group])

    def group_of(self, page: int) -> int:
        return page // self.pool_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_held(self, num_tokens: int) -> int:
        """The most pages a sequence of ``num_tokens`` holds at once (``held_pages``)."""
        return held_pages(num_tokens, self.page_size, self.window, self.max_chunk)

    def dead_pages(self, position: int) -> int:
        """Leading pages of a sequence that no query at ``position`` or later reads (every
        position in them <= position - window); 0 without a window."""
        if self.window is None:
            return 0
        return max(0, (position - self.window + 1) // self.page_size)

    # -- per-sequence allocation -------------------------------------------------------
    def start_group(self, page_ids: Sequence[int]) -> int:
        """The group of a sequence's first page; for a sequence with none yet, the group it
        would start in: the one with the most free pages (least loaded; ties: lowest)."""
        if page_ids:
            return self.group_of(page_ids[0])
        return max(range(self.groups), key=lambda g: (self.num_free_in(g), -g))

    def _groups_of(self, page_ids: Sequence[int], n: int) -> list[int]:
        """Groups of the sequence's next ``n`` logical pages."""
        if self.groups == 1:
            return [0] * n
        start, first, ppg = self.start_group(page_ids), len(page_ids), self.pages_per_group
        if first + n > self.groups * ppg:
            raise ValueError(f"a sequence holds at most {self.groups * ppg} pages "
                             f"({self.groups} groups x {ppg}); asked for {first + n}")
        return [(start + j // ppg) % self.groups for j in range(first, first + n)]

    def _fit(self, groups: Sequence[int]) -> bool:
        """Whether every group has free pages for its share of ``groups`` (one per page)."""
        need: dict[int, int] = {}
        for g in groups:
            need[g] = need.get(g, 0) + 1
        return all(c <= self.num_free_in(g) for g, c in need.items())

    def can_extend(self, page_ids: Sequence[int], n: int) -> bool:
        if self.groups == 1:
            return n <= self.num_free_in(0)
        if len(page_ids) + n > self.groups * self.pages_per_group:
            return False
        return self._fit(self._groups_of(page_ids, n))

    def extendable(self, page_ids: Sequence[int]) -> int:
        """How many more pages the sequence could take now (its groups' free pages, in
        logical order, up to the sequence's maximum)."""
        if self.groups == 1:
            return self.num_free_in(0)
        start, ppg = self.start_group(page_ids), self.pages_per_group
        j, total = len(page_ids), 0
        while j < self.groups * ppg:
            free = self.num_free_in((start + j // ppg) % self.groups)
            room = ppg - j % ppg  # pages left in this group's chunk of the sequence
            total += min(free, room)
            if free < room:
                break
            j += room
        return total

    def extend(self, page_ids: Sequence[int], n: int) -> list[int]:
        """The sequence's next ``n`` pages (global ids, logical order); the caller appends
        them to its page list. All or nothing: ValueError past a sequence's maximum,
        OutOfPages when one of its groups is short."""
        if self.groups == 1:  # the common case, a page at a time only past the free list
            if n > self.num_free_in(0):
                raise self._out_of_pages(page_ids, n)
            free = self._free[0]
            cut = len(free) - min(n, len(free))
            out = free[cut:][::-1]  # as popped one by one from the end
            del free[cut:]
            out += [self._take(0) for _ in range(n - len(out))]
        else:
            groups = self._groups_of(page_ids, n)  # ValueError past the sequence's maximum
            if not self._fit(groups):
                raise self._out_of_pages(page_ids, n)
            out = [self._take(g) for g in groups]
        self._refs.update(dict.fromkeys(out, 1))
        return out

    def _out_of_pages(self, page_ids: Sequence[int], n: int) -> OutOfPages:
        return OutOfPages(f"asked for {n} KV pages for a sequence holding "
                           f"{len(page_ids)}; free per group: "
                           f"{[self.num_free_in(g) for g in range(self.groups)]}")

    def _take(self, group: int) -> int:
        """A free page of ``group``, else its least recently used idle cached page (evicted:
        its key is forgotten, so nothing can find the page before it is rewritten; a host tier
        keeps a copy)."""
        if self._free[group]:
            return self._free[group].pop()
        page, _ = self._idle[group].popitem(last=False)
        key = self._key_of.pop(page)
        del self._page_of[key]
        self.num_evictions += 1
        if self.host is not None:  # its copy leaves before the plan reusing it runs
            self.host.spill(key, page)
        return page

    # -- plain allocation (one group) -------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return self.can_extend((), n)

    def allocate(self, n: int) -> list[int]:
        """``n`` pages of a new sequence (``extend`` from nothing)."""
        return self.extend((), n)

    def can_ever_hold(self, num_pages: int) -> bool:
        """Whether an empty pool could hold a sequence of ``num_pages`` pages."""
        if self.groups == 1:
            return num_pages <= self.total
        if num_pages > self.groups * self.pages_per_group:
            return False
        return min(num_pages, self.pages_per_group) <= self.pool_pages - 1

    def free(self, pages: list[int]) -> None:
        """Drop one hold on each page: a page no sequence holds goes back to the free pool,
        or, if it is cached, becomes idle (most recently used end of the LRU). ``pages`` is a
        sequence's pages in order; they go idle last page first, so eviction takes a
        sequence's tail before its head (a head evicted first would leave its cached tail
        unreachable, as a lookup stops at the first missing page)."""
        for b in reversed(pages):
            refs = self._refs.get(b)
            if refs is None:
                raise ValueError(f"page {b} is not allocated (double free?)")
            if refs > 1:
                self._refs[b] = refs - 1
                continue
            del self._refs[b]
            if b in self._key_of:
                self._idle[self.group_of(b)][b] = None
            else:
                self._free[self.group_of(b)].append(b)

    def drop_dead(self, page_ids: list[int], dropped: int, position: int) -> int:
        """A windowed sequence whose next query is at ``position`` gives back its pages the
        window has passed: ``page_ids[dropped:dead]`` are released and become ``FREED_PAGE``
        (``dropped`` leading entries already are); returns the new count. A page no one else
        holds goes to the free list and is not kept in the prefix cache: a cached prefix is
        only reusable whole (a lookup stops at its first missing page, and these go first),
        so keeping them would hold a long windowed prefix's every page to save one window."""
        dead = min(self.dead_pages(position), len(page_ids))
        if dead <= dropped:
            return dropped
        for b in page_ids[dropped:dead]:
            refs = self._refs[b]
            if refs > 1:
                self._refs[b] = refs - 1
                continue
            del self._refs[b]
            key = self._key_of.pop(b, None)
            if key is not None:
                del self._page_of[key]
            self._free[0].append(b)
        page_ids[dropped:dead] = [FREED_PAGE] * (dead - dropped)
        return dead

    # -- prefix cache ------------------------------------------------------------------
    def lookup(self, keys: Sequence[Hashable]) -> list[int]:
        """The cached pages of the longest run of leading pages whose ``keys`` are cached
        (with kvp groups, only as far as each page sits in the group its logical position
        needs, counted from the first page's group). Changes nothing."""
        pages: list[int] = []
        if not self.prefix_caching:
            return pages
        for j, key in enumerate(keys):
            b = self._page_of.get(key)
            if b is None:
                break
            if self.groups > 1 and pages and self.group_of(b) != (
                    self.group_of(pages[0]) + j // self.pages_per_group) % self.groups:
                break
            pages.append(b)
        return pages

    def acquire(self, pages: Sequence[int]) -> None:
        """One more hold on each of ``pages`` (cached pages from ``lookup``)."""
        for b in pages:
            if b in self._refs:
                self._refs[b] += 1
            else:
                del self._idle[self.group_of(b)][b]  # KeyError: not a cached page
                self._refs[b] = 1

    def register(self, page: int, key: Hashable) -> None:
        """``page`` (in use) now holds the computed KV of the full page ``key``. A key
        already cached keeps its page (this one stays uncached, freed normally)."""
        if not self.prefix_caching or key in self._page_of or page in self._key_of:
            return
        if page not in self._refs:
            raise ValueError(f"page {page} is not allocated; only a held page is registered")
        self._page_of[key] = page
        self._key_of[page] = key

    def check_holders(self, page_lists: Sequence[Sequence[int]]) -> None:
        """Every in-use page is held exactly as many times as ``page_lists`` (the page
        tables of every sequence holding pages) list it, and no other page is in use."""
        counts: dict[int, int] = {}
        for pages in page_lists:
            for b in pages:
                counts[b] = counts.get(b, 0) + 1
        assert counts == self._refs, "page reference counts differ from the holders"

    def check(self) -> None:
        """The conservation invariant, per group and overall: free + idle cached + in use ==
        total, no page in two of them, every free or idle page in its own group's pool and
        never a sink; every idle page cached; the key maps each other's inverse."""
        assert self.num_allocated + self.num_free == self.total, (
            self.num_allocated, self.num_free, self.total)
        for g, (free, idle) in enumerate(zip(self._free, self._idle)):
            held = sum(1 for b in self._refs if self.group_of(b) == g)
            assert held + len(free) + len(idle) == self.pool_pages - 1, (
                g, held, len(free), len(idle))
            assert all(self.group_of(b) == g and b % self.pool_pages
                       for b in (*free, *idle)), g
            assert len(set(free)) == len(free), g
            assert all(b in self._key_of for b in idle), g
        assert not any(b % self.pool_pages == 0 for b in self._refs)
        assert all(r >= 1 for r in self._refs.values())
        unheld = [b for free in self._free for b in free] + [b for i in self._idle for b in i]
        assert len(set(unheld)) == len(unheld) and not set(self._refs).intersection(unheld)
        assert not any(b in self._key_of for free in self._free for b in free), \
            "a free page is still cached"
        assert all(self._page_of[k] == b for b, k in self._key_of.items())
        assert len(self._page_of) == len(self._key_of)

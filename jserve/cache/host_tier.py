"""The prefix cache's host tier (pure Python: the scheduler and the simulator use it without
JAX): a bounded pool of host page slots holding copies of prefix pages the device evicted.

When ``PageAllocator`` evicts an idle cached page to reuse its page, it hands the page's key
and page here (``spill``): the key gets a host slot and the page a pending copy to it (an
*offload*, carried out by the engine before the plan that reuses the page runs). A prompt
whose leading pages the device no longer holds finds them here (``lookup``) and takes them
back by copy (a *restore* into fresh device pages) instead of recomputing them.

The tier is inclusive: a restored page keeps its host copy, so a page that goes device ->
host -> device -> host is copied out once. Slots are evicted least recently used first.
Spills arrive in the device's eviction order, a sequence's tail before its head, and a
restore touches a run's pages tail first, so here too a tail goes before its head (a head
evicted first would strand its tail: a lookup stops at the first missing page). Slots a
request is restoring from in the plan being built are pinned, never evicted under it.
Invariant: free + used == capacity, each slot in one of them, the maps inverse.
"""
from __future__ import annotations

import collections
from typing import Hashable, Sequence

HostMove = tuple[int, int]  # an offload (device page, host slot) or restore (slot, page)


class HostTier:
    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"host tier pages must be >= 0, got {num_pages}")
        self.capacity = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._slot_of: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._key_of: dict[int, Hashable] = {}
        self._pinned: set[int] = set()
        # Copies the next plan carries out (``take_moves``): offloads (slot -> page: one
        # per slot, the last page given it) before restores.
        self.offloads: dict[int, int] = {}
        self.restores: list[HostMove] = []
        # Pages copied out, pages copied back, host evictions, spills dropped (all pinned).
        self.num_offloaded = self.num_restored = 0
        self.num_evictions = self.num_dropped = 0

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    def spill(self, key: Hashable, page: int) -> None:
        """The device evicts cached page ``key`` from ``page``: keep a copy (a page already
        here only becomes most recently used), evicting the least recently used unpinned
        slot when none is free; with none to evict the page is dropped."""
        if key in self._slot_of:
            self._slot_of.move_to_end(key)
            return
        slot = self._free.pop() if self._free else self._evict()
        if slot is None:
            self.num_dropped += 1
            return
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self.offloads[slot] = page
        self.num_offloaded += 1

    def _evict(self) -> int | None:
        for key, slot in self._slot_of.items():
            if slot not in self._pinned:
                del self._slot_of[key], self._key_of[slot]
                self.num_evictions += 1
                self.offloads.pop(slot, None)  # a copy into it in this plan is moot now
                return slot
        return None

    def lookup(self, keys: Sequence[Hashable]) -> list[int]:
        """Slots of the longest run of leading ``keys`` held here. Changes nothing."""
        slots = []
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def pin(self, slots: Sequence[int]) -> None:
        """Hold ``slots`` until ``unpin``: a restore reads them (the plan being built). They
        become most recently used (tail first), so evictions meanwhile meet no pinned slot
        before an unpinned one."""
        self._pinned.update(slots)
        for slot in reversed(slots):
            self._slot_of.move_to_end(self._key_of[slot])

    def unpin(self, slots: Sequence[int]) -> None:
        self._pinned.difference_update(slots)

    def restore(self, slots: Sequence[int], pages: Sequence[int]) -> None:
        """Copy ``slots`` (pinned: most recently used already, the run's head last) into
        device ``pages`` before the next plan runs."""
        self.restores.extend(zip(slots, pages))
        self.num_restored += len(slots)

    def take_moves(self) -> tuple[tuple[HostMove, ...], tuple[HostMove, ...]]:
        """The pending (offloads, restores), now the plan's; pins end with the plan."""
        moves = tuple((b, s) for s, b in self.offloads.items()), tuple(self.restores)
        self.offloads.clear()
        self.restores.clear()
        self._pinned.clear()
        return moves

    def check(self) -> None:
        """Conservation: free + used == capacity, no slot twice, the key maps inverse."""
        assert len(self._free) + len(self._slot_of) == self.capacity, (
            len(self._free), len(self._slot_of), self.capacity)
        used = set(self._slot_of.values())
        assert len(used) == len(self._slot_of) and not used.intersection(self._free)
        assert len(set(self._free)) == len(self._free)
        assert all(0 <= s < self.capacity for s in (*self._free, *used))
        assert all(self._key_of[s] == k for k, s in self._slot_of.items())
        assert len(self._key_of) == len(self._slot_of)

"""Host-side KV block allocator (pure Python: the scheduler and simulator use it without JAX).

With ``groups > 1`` (KV-cache parallelism) the pool is split into one pool per kvp group of
``num_blocks`` pages each; global block id = ``group * num_blocks + local id``, and local id 0
of every group is that group's sink (padding tokens write there), never handed out. A
sequence's logical page ``j`` lives in group ``(start + j // pages_per_group) % groups`` where
``start`` is the group of its first page, chosen as the least-loaded group when the first page
is allocated; so blocks are allocated per sequence through ``extend`` (the next pages of a
sequence), and every capacity check asks about the groups those pages go to. ``groups == 1``
is one pool with block 0 as the sink, exactly as before.
"""
from __future__ import annotations

from typing import Sequence


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, *, groups: int = 1,
                 pages_per_group: int | None = None):
        """``num_blocks`` pages per group (sink included); ``pages_per_group`` logical pages of
        a sequence per group (needed when ``groups > 1``)."""
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is reserved), got {num_blocks}")
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        if groups > 1 and (pages_per_group is None or pages_per_group < 1):
            raise ValueError(f"groups={groups} needs pages_per_group >= 1, got {pages_per_group}")
        self.block_size = block_size
        self.groups = groups
        self.pool_blocks = num_blocks
        self.pages_per_group = pages_per_group if groups > 1 else None
        self.total = groups * (num_blocks - 1)
        self._free: list[list[int]] = [
            list(range(g * num_blocks + num_blocks - 1, g * num_blocks, -1)) for g in range(groups)]
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return sum(map(len, self._free))

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    @property
    def tokens_per_group(self) -> int | None:
        """Tokens of a sequence each group holds (None: one group, no boundary)."""
        return None if self.pages_per_group is None else self.pages_per_group * self.block_size

    def num_free_in(self, group: int) -> int:
        return len(self._free[group])

    def group_of(self, block: int) -> int:
        return block // self.pool_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- per-sequence allocation -------------------------------------------------------
    def start_group(self, block_ids: Sequence[int]) -> int:
        """The group of a sequence's first page; for a sequence with none yet, the group it
        would start in: the one with the most free pages (least loaded; ties: lowest)."""
        if block_ids:
            return self.group_of(block_ids[0])
        return max(range(self.groups), key=lambda g: (len(self._free[g]), -g))

    def _groups_of(self, block_ids: Sequence[int], n: int) -> list[int]:
        """Groups of the sequence's next ``n`` logical pages."""
        if self.groups == 1:
            return [0] * n
        start, first, ppg = self.start_group(block_ids), len(block_ids), self.pages_per_group
        if first + n > self.groups * ppg:
            raise ValueError(f"a sequence holds at most {self.groups * ppg} pages "
                             f"({self.groups} groups x {ppg}); asked for {first + n}")
        return [(start + j // ppg) % self.groups for j in range(first, first + n)]

    def _fit(self, groups: Sequence[int]) -> bool:
        """Whether every group has free pages for its share of ``groups`` (one per page)."""
        need: dict[int, int] = {}
        for g in groups:
            need[g] = need.get(g, 0) + 1
        return all(c <= len(self._free[g]) for g, c in need.items())

    def can_extend(self, block_ids: Sequence[int], n: int) -> bool:
        if self.groups == 1:
            return n <= len(self._free[0])
        if len(block_ids) + n > self.groups * self.pages_per_group:
            return False
        return self._fit(self._groups_of(block_ids, n))

    def extendable(self, block_ids: Sequence[int]) -> int:
        """How many more pages the sequence could take now (its groups' free pages, in
        logical order, up to the sequence's maximum)."""
        if self.groups == 1:
            return len(self._free[0])
        start, ppg = self.start_group(block_ids), self.pages_per_group
        j, total = len(block_ids), 0
        while j < self.groups * ppg:
            free = len(self._free[(start + j // ppg) % self.groups])
            room = ppg - j % ppg  # pages left in this group's chunk of the sequence
            total += min(free, room)
            if free < room:
                break
            j += room
        return total

    def extend(self, block_ids: Sequence[int], n: int) -> list[int]:
        """The sequence's next ``n`` pages (global ids, logical order); the caller appends
        them to its block list. All or nothing: ValueError past a sequence's maximum,
        OutOfBlocks when one of its groups is short."""
        groups = self._groups_of(block_ids, n)  # ValueError past the sequence's maximum
        if not self._fit(groups):
            raise OutOfBlocks(f"asked for {n} KV blocks for a sequence holding "
                              f"{len(block_ids)}; free per group: {list(map(len, self._free))}")
        out = [self._free[g].pop() for g in groups]
        self._allocated.update(out)
        return out

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
        return min(num_pages, self.pages_per_group) <= self.pool_blocks - 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._allocated:
                raise ValueError(f"block {b} is not allocated (double free?)")
            self._allocated.remove(b)
            self._free[self.group_of(b)].append(b)

    def check(self) -> None:
        """The conservation invariant, per group and overall: allocated + free == total, no
        block in both, every free block in its own group's pool and never a sink."""
        assert self.num_allocated + self.num_free == self.total, (
            self.num_allocated, self.num_free, self.total)
        for g, free in enumerate(self._free):
            held = sum(1 for b in self._allocated if self.group_of(b) == g)
            assert held + len(free) == self.pool_blocks - 1, (g, held, len(free))
            assert all(self.group_of(b) == g and b % self.pool_blocks for b in free), g
            assert len(set(free)) == len(free), g
        assert not any(b % self.pool_blocks == 0 for b in self._allocated)
        assert not self._allocated.intersection(b for free in self._free for b in free)

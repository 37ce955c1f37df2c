"""Host-side KV block allocator (pure Python: the scheduler and simulator use it without JAX).

Block 0 is reserved as the sink that padding tokens write into, so it is never handed out.
"""
from __future__ import annotations


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is reserved), got {num_blocks}")
        self.block_size = block_size
        self.total = num_blocks - 1
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._allocated.update(out)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._allocated:
                raise ValueError(f"block {b} is not allocated (double free?)")
            self._allocated.remove(b)
            self._free.append(b)

    def check(self) -> None:
        """The conservation invariant: allocated + free == total, no block in both."""
        assert self.num_allocated + self.num_free == self.total, (
            self.num_allocated, self.num_free, self.total)
        assert not self._allocated.intersection(self._free)

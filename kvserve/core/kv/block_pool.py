"""A pool of block ids with reference counts and an LRU free list."""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Free list plus refcounts over ``num_blocks`` block ids.

    Invariant: a block is in the free list exactly when its refcount is 0. Blocks are
    taken from the front of the free list and returned to its back, so a freed block
    that still holds cached KV is reused last (least recently freed goes first).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; True when the block became free."""
        rc = self.ref_counts[block]
        if rc <= 0:
            raise RuntimeError(f"KV block {block} freed twice")
        self.ref_counts[block] = rc - 1
        if rc == 1:
            self._free[block] = None
            return True
        return False

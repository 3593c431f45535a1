"""A pool of block ids with reference counts and an LRU free list."""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Free list plus refcounts over ``num_blocks`` block ids.

    Invariant: a block is in the free list exactly when its refcount is 0. Blocks are
    taken from the front of the free list and returned to its back, so a freed block
    that still holds cached KV is reused last (least recently freed goes first) — except
    a free block right after a growing table's last one, which that table takes first
    (see allocate).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n free blocks for the end of a block table whose last block is ``after``.

        Decode attention streams a context's blocks in table order, and the hardware
        prefetcher follows a table only where its blocks are consecutive in memory: the
        blocks after ``after`` are taken while they are free, and the rest, least
        recently freed first, are handed out in address order. Once earlier requests
        have come and gone, the free list is in no address order; handed out in its
        order, their tables made 48 requests of bench-100m's ``mixed`` run 5-8 % longer.
        """
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = []
        if after is not None:
            nxt = after + 1
            while len(blocks) < n and nxt < self.num_blocks and self.ref_counts[nxt] == 0:
                del self._free[nxt]
                blocks.append(nxt)
                nxt += 1
        blocks += sorted(self._free.popitem(last=False)[0] for _ in range(n - len(blocks)))
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

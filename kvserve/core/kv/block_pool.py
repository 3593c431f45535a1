"""A pool of block ids with reference counts and an LRU free list."""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Free list plus refcounts over ``num_blocks`` block ids.

    Invariant: a block is in the free list exactly when its refcount is 0. Blocks are
    taken from the front of the free list and returned to its back, so a freed block
    that still holds cached KV is reused last (least recently freed goes first) — except
    a free block right after a growing table's last one, which that table takes first,
    and the pool's never-used blocks, which new tables take in address order with room
    left after each for it to grow into (see allocate). Never-used blocks are at the
    front of the free list, so either way they go before freed ones (bar a freed block
    past the never-used mark, which a table had grown into).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # blocks from here on were never handed to a new table (some may have been
        # taken by a table growing into them)
        self._unused_from = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        """n free blocks for the end of a block table whose last block is ``after``
        (None: a new table), which expects to grow by up to ``room`` more blocks.

        Decode attention streams a context's blocks in table order, and the hardware
        prefetcher follows a table only where its blocks are consecutive in memory: the
        blocks after ``after`` are taken while they are free, and the rest, least
        recently freed first, are handed out in address order. Once earlier requests
        have come and gone, the free list is in no address order; handed out in its
        order, their tables made whole runs measurably longer.

        A new table takes never-used blocks while there are any, and the next new table
        starts ``room`` blocks after it: packed back to back, each table's growth would
        come from wherever the free list's front happened to be, a jump per block. The
        room is not held: other tables take it once the never-used blocks run out.
        """
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = []
        if after is not None:
            blocks = self._take_run(after + 1, n)
        elif self._unused_from < self.num_blocks:
            blocks = self._take_run(self._next_unused(), n)
            if blocks:
                self._unused_from = blocks[-1] + 1 + room
        blocks += sorted(self._free.popitem(last=False)[0] for _ in range(n - len(blocks)))
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def _take_run(self, start: int, n: int) -> list[int]:
        """Up to n free blocks from ``start`` on, consecutive (out of the free list)."""
        blocks = []
        while len(blocks) < n and start < self.num_blocks and self.ref_counts[start] == 0:
            del self._free[start]
            blocks.append(start)
            start += 1
        return blocks

    def _next_unused(self) -> int:
        """The first never-used block not taken meanwhile by a table growing into it."""
        while self._unused_from < self.num_blocks and self.ref_counts[self._unused_from]:
            self._unused_from += 1
        return self._unused_from

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

"""xLLM's memory pool: each request owns one contiguous run of 2^k blocks.

A buddy allocator manages a pre-allocated pool (``memory_pool_ratio`` of the KV blocks).
A request's KV is contiguous in token order: its block table is always
``range(run_start, run_start + blocks needed)``, so a contiguous-KV kernel could read it
as one slice; kvserve's block-table attention reads it like any other table.

Growth, when a request needs more blocks than its run holds (order k -> k' > k):

1. *Take the buddy*: if every buddy on the way from k to k' is free, the run becomes the
   aligned chunk of order k' that contains it. If the run was its buddy's lower half the
   data stays where it is; if it was an upper half, the used blocks are copied down to
   the new start (the source and destination never overlap).
2. *Move*: otherwise a fresh run of order k' is allocated elsewhere, the used blocks are
   copied there and the old run is freed (and coalesced).
3. Otherwise ``allocate_slots`` returns False and the scheduler preempts, as for paged.

Copies go to ``_pending_copies`` as (src, dst) block pairs; the runner does them before
the step's K/V writes. Within one step a request moves at most once, a destination block
is always freshly taken, and a source block is only ever read, so the copy list is
correct whether it is executed as one gather-then-scatter or pair by pair in order.
"""
from __future__ import annotations

from kvserve.core.kv.interface import KVCacheManager, KVStats
from kvserve.request import Request


def order_for(num_blocks: int) -> int:
    """The smallest k with 2^k >= num_blocks (0 for 0 or 1)."""
    return max(0, num_blocks - 1).bit_length()


class BuddyAllocator:
    """Binary buddy allocator over block ids ``[0, num_blocks)``, any ``num_blocks``.

    The pool starts as maximal aligned power-of-two chunks (100 = 64 + 32 + 4). A chunk
    of order k starts at a multiple of 2^k; its buddy starts at ``start ^ 2^k``. Freeing
    coalesces with free buddies; allocation takes the lowest-addressed chunk of the
    smallest sufficient order and splits it.

    Invariants (checked by :meth:`check`): free chunks and allocated runs are aligned,
    disjoint, inside the pool and together cover it exactly; no free chunk has its free
    buddy of the same order beside it (fully coalesced).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a buddy pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.max_order = num_blocks.bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._free_order: dict[int, int] = {}   # start -> order, free chunks
        self.allocated: dict[int, int] = {}     # start -> order, allocated runs
        start = 0
        while start < num_blocks:
            k = (num_blocks - start).bit_length() - 1
            while start % (1 << k):
                k -= 1
            self._add_free(start, k)
            start += 1 << k

    # -- free lists --------------------------------------------------------------------

    def _add_free(self, start: int, order: int) -> None:
        self._free[order].add(start)
        self._free_order[start] = order

    def _take_free(self, start: int) -> None:
        self._free[self._free_order.pop(start)].discard(start)

    def _is_free(self, start: int, order: int) -> bool:
        return self._free_order.get(start) == order

    @property
    def num_free(self) -> int:
        return sum(len(s) << k for k, s in enumerate(self._free))

    def free_chunks(self) -> list[tuple[int, int]]:
        """(start, order) of every free chunk, by address."""
        return sorted(self._free_order.items())

    def largest_free_order(self) -> int | None:
        for k in range(self.max_order, -1, -1):
            if self._free[k]:
                return k
        return None

    def free_blocks_below(self, order: int) -> int:
        """Free blocks in chunks too small to serve an allocation of ``order``."""
        return sum(len(self._free[k]) << k for k in range(min(order, self.max_order + 1)))

    # -- allocation --------------------------------------------------------------------

    def alloc(self, order: int) -> int | None:
        """Start of a fresh run of 2^order blocks, or None when no chunk is big enough."""
        for k in range(order, self.max_order + 1):
            if self._free[k]:
                start = min(self._free[k])
                self._take_free(start)
                while k > order:  # split, keeping the lower half
                    k -= 1
                    self._add_free(start + (1 << k), k)
                self.allocated[start] = order
                return start
        return None

    def free(self, start: int) -> None:
        """Return a run; it coalesces with free buddies."""
        order = self.allocated.pop(start)
        while order < self.max_order:
            buddy = start ^ (1 << order)
            if not self._is_free(buddy, order):
                break
            self._take_free(buddy)
            start = min(start, buddy)
            order += 1
        self._add_free(start, order)

    def can_merge(self, start: int, new_order: int) -> bool:
        """True when run ``start`` can become the aligned chunk of ``new_order`` holding it:
        every buddy on the way up is free at exactly its order."""
        order = self.allocated[start]
        if new_order > self.max_order:
            return False
        for k in range(order, new_order):
            if not self._is_free((start >> k << k) ^ (1 << k), k):
                return False
        return True

    def merge(self, start: int, new_order: int) -> int:
        """Grow run ``start`` into its buddies (check :meth:`can_merge` first); returns the
        new start, which differs from ``start`` when a lower buddy was taken."""
        order = self.allocated.pop(start)
        for k in range(order, new_order):
            self._take_free((start >> k << k) ^ (1 << k))
        new_start = start >> new_order << new_order
        self.allocated[new_start] = new_order
        return new_start

    # -- checking ------------------------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError if an invariant is broken (tests call this)."""
        spans = [(s, k, "free") for s, k in self._free_order.items()]
        spans += [(s, k, "used") for s, k in self.allocated.items()]
        spans.sort()
        pos = 0
        for start, k, kind in spans:
            assert start == pos, f"gap or overlap at block {pos} (next chunk at {start})"
            assert start % (1 << k) == 0, f"{kind} chunk {start} of order {k} is misaligned"
            pos = start + (1 << k)
        assert pos == self.num_blocks, f"chunks cover {pos} of {self.num_blocks} blocks"
        for k, starts in enumerate(self._free):
            assert all(self._free_order.get(s) == k for s in starts), "free lists disagree"
            for s in starts:
                assert not self._is_free(s ^ (1 << k), k), f"free buddies {s} not coalesced"
        assert sum(len(s) for s in self._free) == len(self._free_order)


class BuddyKVCacheManager(KVCacheManager):
    """Each request owns one run of 2^k contiguous blocks from a buddy allocator."""

    def __init__(self, num_blocks: int, block_size: int, memory_pool_ratio: float = 1.0
                 ) -> None:
        if not 0.0 < memory_pool_ratio <= 1.0:
            raise ValueError(f"memory_pool_ratio must be in (0, 1], got {memory_pool_ratio}")
        pool = max(1, int(num_blocks * memory_pool_ratio))
        super().__init__(pool, block_size)
        self.buddy = BuddyAllocator(pool)
        self._runs: dict[str, int] = {}     # request id -> run start
        self._tokens: dict[str, int] = {}   # request id -> tokens in KV after this step
        self._next_order = 0                # order of the latest run asked for
        self.moved_blocks = 0
        self.num_moves = 0

    @classmethod
    def from_config(cls, cache, num_blocks: int) -> BuddyKVCacheManager:
        return cls(num_blocks, cache.block_size, cache.memory_pool_ratio)

    def max_request_tokens(self) -> int:
        return (1 << self.buddy.max_order) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        rid = req.request_id
        total = req.num_computed_tokens + num_new_tokens
        need = order_for(self.blocks_for(total))
        start = self._runs.get(rid)
        if start is None:
            self._next_order = need
            start = self.buddy.alloc(need)
            if start is None:
                return False
        elif need > self.buddy.allocated[start]:
            self._next_order = need
            start = self._grow(start, need, self.blocks_for(req.num_computed_tokens))
            if start is None:
                return False
        self._runs[rid] = start
        self._tokens[rid] = total
        return True

    def _grow(self, start: int, order: int, used_blocks: int) -> int | None:
        if self.buddy.can_merge(start, order):
            new = self.buddy.merge(start, order)
        else:
            new = self.buddy.alloc(order)
            if new is None:
                return None
            self.buddy.free(start)
        if new != start and used_blocks:
            self._pending_copies += [(start + i, new + i) for i in range(used_blocks)]
            self.moved_blocks += used_blocks
            self.num_moves += 1
        return new

    def truncate(self, req: Request, num_tokens: int) -> None:
        """The run stays (a run is one allocation); only its tokens are counted back."""
        if req.request_id in self._tokens:
            self._tokens[req.request_id] = min(self._tokens[req.request_id], num_tokens)

    def free(self, req: Request) -> None:
        start = self._runs.pop(req.request_id, None)
        self._tokens.pop(req.request_id, None)
        if start is None:
            return
        end = start + (1 << self.buddy.allocated[start])
        # a move planned this step for a request freed before the step runs is moot
        self._pending_copies = [(s, d) for s, d in self._pending_copies
                                if not start <= d < end]
        self.buddy.free(start)

    def block_table(self, req: Request) -> list[int]:
        start = self._runs.get(req.request_id)
        if start is None:
            return []
        return list(range(start, start + self.blocks_for(self._tokens[req.request_id])))

    def stats(self) -> KVStats:
        used_blocks = sum(1 << self.buddy.allocated[s] for s in self._runs.values())
        return KVStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_used_blocks=used_blocks,
            used_tokens=sum(self._tokens.values()),
            allocated_slots=used_blocks * self.block_size,
            unusable_free_blocks=self.buddy.free_blocks_below(self._next_order),
            moved_blocks=self.moved_blocks,
        )

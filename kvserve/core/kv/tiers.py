"""Slower KV tiers below the block pool: host swap space and a disk file.

These classes only account for slots; the model runner moves the bytes, following
the :class:`KVTransfer` list the KV manager hands to each step.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Transfer kinds. Reads of the pool (out of it) run before writes into it.
SWAP_OUT, OFFLOAD, SWAP_IN, ONLOAD = "swap_out", "offload", "swap_in", "onload"
READS_POOL = (SWAP_OUT, OFFLOAD)


@dataclass(frozen=True)
class KVTransfer:
    kind: str   # swap_out / offload: pool block -> slot; swap_in / onload: slot -> pool block
    block: int
    slot: int


class SwapSpace:
    """Slots of host memory holding preempted requests' blocks."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        self._free.extend(slots)


class DiskTier:
    """Evicted prefix-cache blocks by content hash, in slots of a file; LRU when full."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, oldest first
        self._free = list(range(num_slots - 1, -1, -1))
        self.hits = 0
        self.stores = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def store(self, block_hash: int) -> int:
        """A slot to write this block into (reusing the least recently used one)."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return -1  # already on disk: nothing to write
        slot = self._free.pop() if self._free else self._slot_of.popitem(last=False)[1]
        self._slot_of[block_hash] = slot
        self.stores += 1
        return slot

    def lookup(self, block_hash: int) -> int | None:
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self._slot_of.move_to_end(block_hash)
            self.hits += 1
        return slot

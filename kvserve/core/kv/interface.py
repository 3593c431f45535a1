"""The contract between the scheduler and KV memory.

Every memory design expresses a request's KV as a block table over one shared pool of
``num_blocks`` blocks of ``block_size`` token slots, so the model runner and its
attention code never know which design is in use. A new design is one new file that
subclasses :class:`KVCacheManager`, plus one registration line in ``kv/__init__.py``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvserve.config.cache import CacheConfig
from kvserve.core.kv.tiers import KVTransfer
from kvserve.request import Request


@dataclass(frozen=True)
class KVStats:
    """A snapshot of KV memory.

    ``used_tokens``: slots that hold a real token of a live request.
    ``allocated_slots``: slots handed to requests (allocated or reserved).
    ``unusable_free_blocks``: free blocks that cannot serve the next allocation
    (e.g. buddy runs too small) — external fragmentation.
    """

    num_blocks: int
    block_size: int
    num_used_blocks: int
    used_tokens: int
    allocated_slots: int
    unusable_free_blocks: int = 0
    moved_blocks: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, cumulative
    prefix_hits: int = 0     # of which were found cached

    @property
    def usage(self) -> float:
        """Share of blocks not free (vLLM's kv_cache_usage)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def utilization(self) -> float:
        """Share of handed-out slots holding real tokens (1.0 when nothing is handed out)."""
        return self.used_tokens / self.allocated_slots if self.allocated_slots else 1.0

    @property
    def internal_fragmentation(self) -> float:
        """Share of handed-out slots that hold no token."""
        return 1.0 - self.utilization if self.allocated_slots else 0.0

    @property
    def fragmentation(self) -> float:
        """Slots lost to fragmentation (handed out but empty, or free but unusable) / all."""
        total = self.num_blocks * self.block_size
        lost = self.allocated_slots - self.used_tokens + self.unusable_free_blocks * self.block_size
        return max(0.0, lost / total) if total else 0.0

    @property
    def external_fragmentation(self) -> float:
        free = self.num_blocks - self.num_used_blocks
        return self.unusable_free_blocks / free if free else 0.0


class KVCacheManager(ABC):
    """Owns KV memory accounting; never touches tensors.

    Invariants every implementation keeps:
    - a block id in any block table is in ``[0, num_blocks)``;
    - two live requests never share a block unless it is read-only shared (refcounted);
    - after ``free`` of every request, ``stats().num_used_blocks`` is 0 (cached but
      unreferenced prefix blocks count as free).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._pending_copies: list[tuple[int, int]] = []

    @classmethod
    def from_config(cls, cache: CacheConfig, num_blocks: int) -> KVCacheManager:
        """Build from the cache settings; designs with options of their own override this
        (only paged takes the tiers' ``swap_slots`` / ``disk_slots`` keywords)."""
        return cls(num_blocks, cache.block_size)

    def reset_prefix_cache(self) -> None:
        """Forget cached KV contents (after a failed step may have left blocks unwritten)."""

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_request_tokens(self) -> int:
        """The most tokens one request alone can ever hold."""
        return self.num_blocks * self.block_size

    def get_computed_tokens(self, req: Request) -> int:
        """Tokens of a new request already in the cache (prefix caching); 0 by default."""
        return 0

    @abstractmethod
    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` after ``req.num_computed_tokens``.

        Returns False, changing nothing, when there is no room.
        """

    @abstractmethod
    def free(self, req: Request) -> None:
        """Release everything ``req`` holds; a no-op for an unknown request."""

    @abstractmethod
    def block_table(self, req: Request) -> list[int]:
        """The blocks holding ``req``'s tokens, in token order."""

    def group_tables(self, req: Request) -> list[list[int]]:
        """Each KV group's table (see groups.py), the first being ``block_table``'s;
        one table serves every layer unless the manager keeps groups."""
        return [self.block_table(req)]

    @abstractmethod
    def stats(self) -> KVStats:
        """Current usage, utilisation and fragmentation."""

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep KV for ``req``'s first ``num_tokens`` tokens only (rejected draft tokens'
        slots go back), freeing blocks that hold none of them where the design hands out
        single blocks. Needed for speculative decoding; a design without it is refused
        when speculation is on."""
        raise NotImplementedError(f"{type(self).__name__} cannot truncate a request's KV")

    @classmethod
    def supports_truncate(cls) -> bool:
        return cls.truncate is not KVCacheManager.truncate

    def swap_out(self, req: Request) -> bool:
        """Move a preempted request's KV to swap space; False: not supported or no room."""
        return False

    def is_swapped(self, req: Request) -> bool:
        return False

    def swap_in(self, req: Request, num_new_tokens: int) -> bool:
        """Bring a swapped request's KV back with room for ``num_new_tokens`` more;
        False, changing nothing, when there is no room yet."""
        return False

    def take_transfers(self) -> list[KVTransfer]:
        """Moves between the pool and slower tiers (swap, disk) for this step."""
        return []

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must do before the next step."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

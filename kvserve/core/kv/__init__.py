"""KV memory designs, chosen by name (``kv_manager``).

- ``paged``: any free block for any request (vLLM PagedAttention).
- ``buddy``: one contiguous run of 2^k blocks per request from a buddy allocator over a
  pre-allocated pool (xLLM memory pool).
- ``contiguous``: prompt + max_tokens reserved up front per request (HF static baseline).

A manager class may override ``from_args(args, num_blocks)`` to read its options from
:class:`~kvserve.config.EngineArgs`; by default it is built as ``cls(num_blocks,
block_size)``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.core.kv.buddy import BuddyKVCacheManager
from kvserve.core.kv.contiguous import ContiguousKVCacheManager
from kvserve.core.kv.interface import KVCacheManager, KVStats
from kvserve.core.kv.paged import PagedKVCacheManager

if TYPE_CHECKING:
    from kvserve.config import EngineArgs

KV_MANAGERS: dict[str, type[KVCacheManager]] = {
    "paged": PagedKVCacheManager,
    "buddy": BuddyKVCacheManager,
    "contiguous": ContiguousKVCacheManager,
}


def create_kv_manager(args: EngineArgs, num_blocks: int, **tier_slots: int) -> KVCacheManager:
    """The manager ``args.kv_manager`` names, over ``num_blocks`` blocks.

    ``tier_slots`` (swap_slots, disk_slots) size the slower tiers; only paged has them.
    """
    try:
        cls = KV_MANAGERS[args.kv_manager]
    except KeyError:
        raise ValueError(f"kv_manager must be one of {sorted(KV_MANAGERS)}, "
                         f"got {args.kv_manager!r}") from None
    tiers = {k: v for k, v in tier_slots.items() if v}
    return cls.from_args(args, num_blocks, **tiers)


__all__ = ["KVCacheManager", "KVStats", "create_kv_manager", "KV_MANAGERS",
           "PagedKVCacheManager", "BuddyKVCacheManager", "ContiguousKVCacheManager"]

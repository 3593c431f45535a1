"""KV memory designs, chosen by name (``kv_manager``), registered here in one line each.

- ``paged``: any free block for any request (vLLM PagedAttention).
- ``buddy``: one contiguous run of 2^k blocks per request from a buddy allocator over a
  pre-allocated pool (xLLM memory pool).
- ``contiguous``: prompt + max_tokens reserved up front per request (HF static baseline).

A manager class builds itself with ``from_config(cache_config, num_blocks)``; the
default is ``cls(num_blocks, block_size)``, and a design with options of its own
overrides it.
"""
from __future__ import annotations

from kvserve.config.cache import CacheConfig
from kvserve.core.kv.buddy import BuddyKVCacheManager
from kvserve.core.kv.contiguous import ContiguousKVCacheManager
from kvserve.core.kv.groups import KVGroups
from kvserve.core.kv.hybrid import HybridKVCacheManager
from kvserve.core.kv.interface import KVCacheManager, KVStats
from kvserve.core.kv.paged import PagedKVCacheManager
from kvserve.registry import Registry

KV_MANAGERS: Registry[type[KVCacheManager]] = Registry("kv_manager")
KV_MANAGERS.register("paged", PagedKVCacheManager)
KV_MANAGERS.register("buddy", BuddyKVCacheManager)
KV_MANAGERS.register("contiguous", ContiguousKVCacheManager)


def create_kv_manager(cache: CacheConfig, num_blocks: int, swap_slots: int = 0,
                      disk_slots: int = 0, groups: KVGroups | None = None,
                      step_tokens: int = 0) -> KVCacheManager:
    """The manager ``cache.kv_manager`` names, over ``num_blocks`` blocks; the slower
    tiers' slots are passed only when there are some (only paged has tiers). With KV
    groups (a model mixing windowed and full layers), paged memory keeps a table per
    group (``step_tokens``: the most tokens a request computes in a step)."""
    if groups is not None:
        return HybridKVCacheManager(num_blocks, cache.block_size, groups.windows,
                                    cache.enable_prefix_caching, step_tokens)
    tiers = {k: v for k, v in (("swap_slots", swap_slots), ("disk_slots", disk_slots)) if v}
    return KV_MANAGERS[cache.kv_manager].from_config(cache, num_blocks, **tiers)


__all__ = ["KVCacheManager", "KVStats", "create_kv_manager", "KV_MANAGERS",
           "PagedKVCacheManager", "BuddyKVCacheManager", "ContiguousKVCacheManager"]

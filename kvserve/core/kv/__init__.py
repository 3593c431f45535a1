"""KV memory designs, chosen by name (``kv_manager``)."""
from __future__ import annotations

from kvserve.core.kv.interface import KVCacheManager, KVStats
from kvserve.core.kv.paged import PagedKVCacheManager

KV_MANAGERS: dict[str, type[KVCacheManager]] = {
    "paged": PagedKVCacheManager,
}


def create_kv_manager(name: str, num_blocks: int, block_size: int) -> KVCacheManager:
    try:
        cls = KV_MANAGERS[name]
    except KeyError:
        raise ValueError(
            f"kv_manager must be one of {sorted(KV_MANAGERS)}, got {name!r}") from None
    return cls(num_blocks, block_size)


__all__ = ["KVCacheManager", "KVStats", "create_kv_manager", "KV_MANAGERS"]

"""vLLM's PagedAttention memory: any free block serves any request."""
from __future__ import annotations

from kvserve.core.kv.block_pool import BlockPool
from kvserve.core.kv.interface import KVCacheManager, KVStats
from kvserve.request import Request


class PagedKVCacheManager(KVCacheManager):
    """Blocks are allocated one at a time as a request grows, from anywhere in the pool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        table = self._tables.get(req.request_id, [])
        total = req.num_computed_tokens + num_new_tokens
        need = self.blocks_for(total) - len(table)
        if need > self.pool.num_free:
            return False
        if need > 0:
            table = table + self.pool.allocate(need)
        self._tables[req.request_id] = table
        self._tokens[req.request_id] = total
        return True

    def free(self, req: Request) -> None:
        for b in reversed(self._tables.pop(req.request_id, [])):
            self.pool.decref(b)
        self._tokens.pop(req.request_id, None)

    def block_table(self, req: Request) -> list[int]:
        return self._tables.get(req.request_id, [])

    def stats(self) -> KVStats:
        used_blocks = self.num_blocks - self.pool.num_free
        allocated = sum(len(t) for t in self._tables.values()) * self.block_size
        return KVStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_used_blocks=used_blocks,
            used_tokens=sum(self._tokens.values()),
            allocated_slots=allocated,
        )

"""A fourth KV memory design, written as a user would add one: this file plus one
registration line. Each request takes single blocks from a stack of free ones (the
block freed last is handed out first), so tables are scattered in a way none of the
in-tree designs produce."""
from __future__ import annotations

from kvserve.core.kv import KVCacheManager, KVStats
from kvserve.request import Request


class StackKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._free = list(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        table = self._tables.get(req.request_id, [])
        total = req.num_computed_tokens + num_new_tokens
        need = self.blocks_for(total) - len(table)
        if need > len(self._free):
            return False
        table = table + [self._free.pop() for _ in range(max(0, need))]
        self._tables[req.request_id] = table
        self._tokens[req.request_id] = total
        return True

    def free(self, req: Request) -> None:
        self._free.extend(self._tables.pop(req.request_id, []))
        self._tokens.pop(req.request_id, None)

    def block_table(self, req: Request) -> list[int]:
        return self._tables.get(req.request_id, [])

    def stats(self) -> KVStats:
        used = self.num_blocks - len(self._free)
        return KVStats(num_blocks=self.num_blocks, block_size=self.block_size,
                       num_used_blocks=used, used_tokens=sum(self._tokens.values()),
                       allocated_slots=used * self.block_size)

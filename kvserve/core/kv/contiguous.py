"""The static baseline (HF transformers ``generate``): reserve the whole length up front.

A request reserves one contiguous range of blocks for everything it could ever hold,
``prompt + max_tokens`` (``max_tokens`` is already capped by ``max_model_len``), the
first time it is scheduled; it never grows, never moves, and only frees at the end.
Ranges are placed first-fit by address. The reserved-but-unused slots are internal
fragmentation; free holes too short for the next reservation are external fragmentation.
"""
from __future__ import annotations

import bisect

from kvserve.core.kv.interface import KVCacheManager, KVStats
from kvserve.request import Request


class ContiguousKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._starts: list[int] = []            # sorted starts of reserved ranges
        self._length: dict[int, int] = {}       # start -> reserved blocks
        self._ranges: dict[str, int] = {}       # request id -> start
        self._tokens: dict[str, int] = {}       # request id -> tokens in KV after this step
        self._next_need = 0                     # blocks of the latest reservation asked for

    def holes(self) -> list[tuple[int, int]]:
        """(start, length) of every free gap between reservations, by address."""
        out, pos = [], 0
        for start in self._starts:
            if start > pos:
                out.append((pos, start - pos))
            pos = start + self._length[start]
        if pos < self.num_blocks:
            out.append((pos, self.num_blocks - pos))
        return out

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        rid = req.request_id
        total = req.num_computed_tokens + num_new_tokens
        start = self._ranges.get(rid)
        if start is None:
            need = self.blocks_for(max(req.max_total_tokens, total))
            self._next_need = need
            start = next((s for s, n in self.holes() if n >= need), None)
            if start is None:
                return False
            bisect.insort(self._starts, start)
            self._length[start] = need
            self._ranges[rid] = start
        elif self.blocks_for(total) > self._length[start]:
            raise RuntimeError(f"request {rid} outgrew its reservation of "
                               f"{self._length[start]} blocks ({total} tokens)")
        self._tokens[rid] = total
        return True

    def truncate(self, req: Request, num_tokens: int) -> None:
        """The reservation stays (it was made for the whole request)."""
        if req.request_id in self._tokens:
            self._tokens[req.request_id] = min(self._tokens[req.request_id], num_tokens)

    def free(self, req: Request) -> None:
        start = self._ranges.pop(req.request_id, None)
        self._tokens.pop(req.request_id, None)
        if start is not None:
            self._starts.remove(start)
            del self._length[start]

    def block_table(self, req: Request) -> list[int]:
        start = self._ranges.get(req.request_id)
        if start is None:
            return []
        return list(range(start, start + self.blocks_for(self._tokens[req.request_id])))

    def stats(self) -> KVStats:
        reserved = sum(self._length.values())
        unusable = sum(n for _, n in self.holes() if n < self._next_need)
        return KVStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_used_blocks=reserved,
            used_tokens=sum(self._tokens.values()),
            allocated_slots=reserved * self.block_size,
            unusable_free_blocks=unusable,
        )

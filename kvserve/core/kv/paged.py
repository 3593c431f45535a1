"""vLLM's PagedAttention memory: any free block serves any request, shared by prefix."""
from __future__ import annotations

from kvserve.config import EngineArgs
from kvserve.core.kv.block_pool import BlockPool
from kvserve.core.kv.interface import KVCacheManager, KVStats
from kvserve.core.kv.prefix_cache import PrefixCache, chain_hashes
from kvserve.request import Request


class PagedKVCacheManager(KVCacheManager):
    """Blocks are allocated one at a time as a request grows, from anywhere in the pool.

    With prefix caching, every block that a request fills is registered by content
    hash; a later request whose prompt starts with the same full blocks takes them
    (refcount + 1) instead of computing them. A freed block keeps its KV and its hash
    until the pool reuses it, least recently freed first. Blocks are registered when
    scheduled, before the step writes them: K/V of a step are written before any
    attention of that step reads them, so a hit in the same step reads valid KV.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
                 ) -> None:
        super().__init__(num_blocks, block_size)
        self.pool = BlockPool(num_blocks)
        self.cache = PrefixCache() if enable_prefix_caching else None
        self._tables: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}
        self._hashes: dict[str, list[int]] = {}  # hashes of each request's full blocks
        self._registered: dict[str, int] = {}  # how many of its blocks are in the cache

    @classmethod
    def from_args(cls, args: EngineArgs, num_blocks: int) -> PagedKVCacheManager:
        return cls(num_blocks, args.block_size, args.enable_prefix_caching)

    def reset_prefix_cache(self) -> None:
        if self.cache is not None:
            queries, hits = self.cache.queries, self.cache.hits
            self.cache = PrefixCache()
            self.cache.queries, self.cache.hits = queries, hits

    def get_computed_tokens(self, req: Request) -> int:
        if self.cache is None or req.request_id in self._tables:
            return 0
        # never the whole sequence: its last token must be computed to sample from it
        full = (req.num_tokens - 1) // self.block_size
        tokens = req.token_slice(0, full * self.block_size)
        hashes = chain_hashes(tokens, self.block_size, full, self._hashes.get(req.request_id, []))
        self._hashes[req.request_id] = hashes
        hit_blocks = []
        for h in hashes:
            block = self.cache.lookup(h)
            if block is None:
                break
            hit_blocks.append(block)
        for block in hit_blocks:
            self.pool.incref(block)
        self._tables[req.request_id] = hit_blocks
        self._registered[req.request_id] = len(hit_blocks)
        computed = len(hit_blocks) * self.block_size
        self._tokens[req.request_id] = computed
        if req.num_preemptions == 0:
            self.cache.queries += req.num_tokens
            self.cache.hits += computed
        return computed

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        rid = req.request_id
        table = self._tables.get(rid, [])
        total = req.num_computed_tokens + num_new_tokens
        need = self.blocks_for(total) - len(table)
        if need > self.pool.num_free:
            return False
        if need > 0:
            new = self.pool.allocate(need)
            if self.cache is not None:
                for block in new:
                    self.cache.evict(block)
            table = table + new
        self._tables[rid] = table
        self._tokens[rid] = total
        if self.cache is not None:
            self._register_full_blocks(req, total)
        return True

    def _register_full_blocks(self, req: Request, total: int) -> None:
        rid = req.request_id
        full = total // self.block_size
        done = self._registered.get(rid, 0)
        if full <= done:
            return
        known = self._hashes.get(rid, [])
        if len(known) < full:
            tokens = req.token_slice(0, full * self.block_size)
            known = self._hashes[rid] = chain_hashes(tokens, self.block_size, full, known)
        table = self._tables[rid]
        for i in range(done, full):
            self.cache.register(known[i], table[i])
        self._registered[rid] = full

    def free(self, req: Request) -> None:
        # tail first: the end of a sequence is the least likely to be shared, evict it first
        for b in reversed(self._tables.pop(req.request_id, [])):
            self.pool.decref(b)
        self._tokens.pop(req.request_id, None)
        self._hashes.pop(req.request_id, None)
        self._registered.pop(req.request_id, None)

    def block_table(self, req: Request) -> list[int]:
        return self._tables.get(req.request_id, [])

    def stats(self) -> KVStats:
        used_blocks = self.num_blocks - self.pool.num_free
        return KVStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_used_blocks=used_blocks,
            used_tokens=sum(self._tokens.values()),
            allocated_slots=sum(len(t) for t in self._tables.values()) * self.block_size,
            prefix_queries=self.cache.queries if self.cache else 0,
            prefix_hits=self.cache.hits if self.cache else 0,
        )

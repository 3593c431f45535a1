"""vLLM's PagedAttention memory: any free block serves any request, shared by prefix.

Below the pool sit two optional tiers: swap space (a preempted request's blocks are
copied out and back in instead of recomputed) and a disk tier (prefix-cache blocks
evicted from the pool are written to a file and read back on a later hit).
"""
from __future__ import annotations

from kvserve.config.cache import CacheConfig
from kvserve.core.kv.block_pool import BlockPool
from kvserve.core.kv.interface import KVCacheManager, KVStats
from kvserve.core.kv.prefix_cache import PrefixCache, chain_hashes
from kvserve.core.kv.tiers import (OFFLOAD, ONLOAD, SWAP_IN, SWAP_OUT, DiskTier, KVTransfer,
                                   SwapSpace)
from kvserve.request import Request


class PagedKVCacheManager(KVCacheManager):
    """Blocks are allocated one at a time as a request grows, from anywhere in the pool.

    With prefix caching, every block that a request fills is registered by content
    hash; a later request whose prompt starts with the same full blocks takes them
    (refcount + 1) instead of computing them. A freed block keeps its KV and its hash
    until the pool reuses it, least recently freed first (or first, when it follows the
    last block of a growing request; while the pool has never-used blocks, a new table
    leaves room after it to grow into: see BlockPool.allocate). Blocks are registered when
    scheduled, before the step writes them: K/V of a step are written before any
    attention of that step reads them, so a hit in the same step reads valid KV.

    The part-filled block at the end of a prompt cannot be shared: each sequence writes
    its own tokens into it. When another live request (an n > 1 sibling, a repeated
    prompt) has already computed the same prompt, a new request gets a copy of that
    block (copy on write: the runner copies it before the step) and computes only its
    last prompt token, whose logits it samples from.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 swap_slots: int = 0, disk_slots: int = 0) -> None:
        super().__init__(num_blocks, block_size)
        self.pool = BlockPool(num_blocks)
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.swap = SwapSpace(swap_slots) if swap_slots else None
        self.disk = DiskTier(disk_slots) if disk_slots and self.cache is not None else None
        self._tables: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}
        self._hashes: dict[str, list[int]] = {}  # hashes of each request's full blocks
        self._registered: dict[str, int] = {}  # how many of its blocks are in the cache
        self._swapped: dict[str, list[int]] = {}  # request -> swap slots, in block order
        self._transfers: list[KVTransfer] = []
        self._slots_released: list[int] = []  # swap slots read by this step's copies
        self._released_last_step: list[int] = []  # ... and by the previous step's: free now
        self._pinned: list[int] = []
        self._tail_owner: dict[tuple, Request] = {}  # prompt tail key -> a live request
        self._tail_key: dict[str, tuple] = {}  # owner's request id -> its key
        self.tail_copies = 0  # part-filled prompt blocks shared by copy, cumulative
        self.moved = {SWAP_OUT: 0, SWAP_IN: 0, OFFLOAD: 0, ONLOAD: 0}  # blocks, cumulative

    @classmethod
    def from_config(cls, cache: CacheConfig, num_blocks: int, swap_slots: int = 0,
                    disk_slots: int = 0) -> PagedKVCacheManager:
        return cls(num_blocks, cache.block_size, cache.enable_prefix_caching, swap_slots,
                   disk_slots)

    # -- prefix cache ------------------------------------------------------------------

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
        hashes = chain_hashes(tokens, self.block_size, full, self._hashes.get(req.request_id, []),
                              req.prefix_root)
        self._hashes[req.request_id] = hashes
        hit_blocks = []
        for h in hashes:
            block = self.cache.lookup(h)
            if block is not None:
                self.pool.incref(block)
            else:
                block = self._onload(h)
                if block is None:
                    break
            hit_blocks.append(block)
        self._registered[req.request_id] = len(hit_blocks)
        cached = len(hit_blocks) * self.block_size
        if req.num_preemptions == 0:  # the metric counts cached blocks, not tail copies
            self.cache.queries += req.num_tokens
            self.cache.hits += cached
        computed = cached + self._copy_tail(req, hashes, hit_blocks)
        self._tables[req.request_id] = hit_blocks
        self._tokens[req.request_id] = computed
        return computed

    def _copy_tail(self, req: Request, hashes: list[int], table: list[int]) -> int:
        """Share the prompt's part-filled last block by copy from a request that computed
        it (appended to ``table`` once every full block was a hit); returns the tokens
        gained (0: none). Otherwise ``req`` may become the donor for later requests."""
        full = len(hashes)
        start, end = full * self.block_size, req.num_tokens - 1  # the last token is computed
        if end <= start:
            return 0
        key = (hashes[-1] if hashes else req.prefix_root, tuple(req.token_slice(start, end)))
        donor = self._tail_owner.setdefault(key, req)
        if donor is req:
            self._tail_key[req.request_id] = key
        donor_table = self._tables.get(donor.request_id, [])
        if (donor is req or len(table) < full or donor.num_computed_tokens < end
                or len(donor_table) <= full or self.pool.num_free == 0):
            return 0
        block = self._take_blocks(1, table)[0]
        self._pending_copies.append((donor_table[full], block))
        table.append(block)
        self.tail_copies += 1
        return end - start

    def _onload(self, block_hash: int) -> int | None:
        """Bring a block back from disk into a fresh pool block (refcount 1)."""
        if self.disk is None or self.pool.num_free == 0:
            return None
        slot = self.disk.lookup(block_hash)
        if slot is None:
            return None
        block = self._take_blocks(1)[0]
        self._transfers.append(KVTransfer(ONLOAD, block, slot))
        self.moved[ONLOAD] += 1
        self.cache.register(block_hash, block)
        return block

    def pin_prefix(self, token_ids: list[int]) -> int:
        """Hold the cached full blocks of ``token_ids`` forever (KV warm-up); returns tokens."""
        if self.cache is None:
            return 0
        full = len(token_ids) // self.block_size
        pinned = 0
        for h in chain_hashes(token_ids, self.block_size, full, []):
            block = self.cache.lookup(h)
            if block is None:
                break
            self.pool.incref(block)
            self._pinned.append(block)
            pinned += self.block_size
        return pinned

    # -- allocation --------------------------------------------------------------------

    def _take_blocks(self, n: int, table: list[int] | None = None, room: int = 0) -> list[int]:
        """n blocks for the end of ``table`` (a new table when None or empty), which may
        grow by ``room`` more blocks."""
        blocks = self.pool.allocate(n, table[-1] if table else None, room)
        if self.cache is not None:
            for block in blocks:
                block_hash = self.cache.hash_of(block)
                if block_hash is not None and self.disk is not None:
                    slot = self.disk.store(block_hash)
                    if slot >= 0:
                        self._transfers.append(KVTransfer(OFFLOAD, block, slot))
                        self.moved[OFFLOAD] += 1
                self.cache.evict(block)
        return blocks

    def _room(self, req: Request, num_blocks: int) -> int:
        """How many blocks past its first ``num_blocks`` a request may still grow into."""
        return max(0, self.blocks_for(req.max_total_tokens) - num_blocks)

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        rid = req.request_id
        table = self._tables.get(rid, [])
        total = req.num_computed_tokens + num_new_tokens
        need = self.blocks_for(total) - len(table)
        if need > self.pool.num_free:
            return False
        if need > 0:
            table = table + self._take_blocks(need, table, self._room(req, len(table) + need))
        self._tables[rid] = table
        self._tokens[rid] = total
        if self.cache is not None:
            self._register_full_blocks(req, total)
        return True

    def truncate(self, req: Request, num_tokens: int) -> None:
        rid = req.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        dropped = table[keep:]
        for b in reversed(dropped):
            self.pool.decref(b)
        if dropped and self._pending_copies:
            gone = set(dropped)
            self._pending_copies = [(s, d) for s, d in self._pending_copies if d not in gone]
        self._tables[rid] = table[:keep]
        self._tokens[rid] = min(self._tokens.get(rid, 0), num_tokens)

    def _register_full_blocks(self, req: Request, total: int) -> None:
        """Put the blocks that ``total`` tokens fill into the prefix cache; only blocks
        of tokens the request holds (not draft tokens, which may be rejected)."""
        rid = req.request_id
        full = min(total, req.num_tokens) // self.block_size
        done = self._registered.get(rid, 0)
        if full <= done:
            return
        known = self._hashes.get(rid, [])
        if len(known) < full:
            tokens = req.token_slice(0, full * self.block_size)
            known = self._hashes[rid] = chain_hashes(tokens, self.block_size, full, known,
                                                     req.prefix_root)
        table = self._tables[rid]
        for i in range(done, full):
            self.cache.register(known[i], table[i])
        self._registered[rid] = full

    def free(self, req: Request) -> None:
        # tail first: the end of a sequence is the least likely to be shared, evict it first
        table = self._tables.pop(req.request_id, [])
        for b in reversed(table):
            self.pool.decref(b)
        if self._pending_copies:  # a copy into a block given back is moot
            dropped = set(table)
            self._pending_copies = [(s, d) for s, d in self._pending_copies if d not in dropped]
        key = self._tail_key.pop(req.request_id, None)
        if key is not None and self._tail_owner.get(key) is req:
            del self._tail_owner[key]
        self._tokens.pop(req.request_id, None)
        self._hashes.pop(req.request_id, None)
        self._registered.pop(req.request_id, None)
        slots = self._swapped.pop(req.request_id, None)
        if slots:
            self._slots_released.extend(slots)

    # -- swap --------------------------------------------------------------------------

    def swap_out(self, req: Request) -> bool:
        """Copy a preempted request's blocks to swap space and free them; False if no room."""
        table = self._tables.get(req.request_id, [])
        slots = self.swap.allocate(len(table)) if self.swap is not None and table else None
        if slots is None:
            return False
        self._transfers += [KVTransfer(SWAP_OUT, b, s) for b, s in zip(table, slots)]
        self.moved[SWAP_OUT] += len(slots)
        self.free(req)
        self._swapped[req.request_id] = slots
        return True

    def is_swapped(self, req: Request) -> bool:
        return req.request_id in self._swapped

    def swap_in(self, req: Request, num_new_tokens: int) -> bool:
        """Bring a swapped-out request's blocks back into the pool, with room for
        ``num_new_tokens`` more; False, changing nothing, if the pool lacks room."""
        slots = self._swapped.get(req.request_id)
        total = req.num_computed_tokens + num_new_tokens
        need = self.blocks_for(total)
        if slots is None or need > self.pool.num_free:
            return False
        del self._swapped[req.request_id]
        blocks = self._take_blocks(need, room=self._room(req, need))
        self._transfers += [KVTransfer(SWAP_IN, b, s) for b, s in zip(blocks, slots)]
        self.moved[SWAP_IN] += len(slots)
        self._slots_released.extend(slots)
        self._tables[req.request_id] = blocks
        self._tokens[req.request_id] = total
        self._registered[req.request_id] = 0
        if self.cache is not None:
            self._register_full_blocks(req, total)
        return True

    def take_transfers(self) -> list[KVTransfer]:
        """This step's moves between tiers; swap slots read by the previous step are free."""
        if self.swap is not None:
            self.swap.release(self._released_last_step)
        self._released_last_step, self._slots_released = self._slots_released, []
        transfers, self._transfers = self._transfers, []
        return transfers

    # -- views -------------------------------------------------------------------------

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

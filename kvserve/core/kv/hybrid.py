"""Paged memory for models that mix full-attention and sliding-window layers: one block
pool, one block table per KV group (see groups.py). The full group's table covers the
whole sequence; a windowed group's keeps only the blocks its window still reads, giving
the rest back to the pool as the sequence grows. Attention masks keys outside a
window, so the entries of blocks given back point at block 0, which is never read
unmasked.

With prefix caching, each group's full blocks are registered under the block's chain
hash (tagged by group). A prompt's cached prefix counts as far as the full group has
every block and each windowed group the blocks of its last window: blocks a window
gave back stay cached until the pool reuses them. Preemption recomputes (a swapped-out
request's windows would need their own slots); the part-filled prompt block is not
shared by copy.

A request starts only when its whole prompt fits: a window gives back its blocks only
after the prompt's chunks pass it, so a request admitted into the room the windows
left would preempt itself at its next chunk, and be admitted again, over and over.
"""
from __future__ import annotations

from kvserve.core.kv.block_pool import BlockPool
from kvserve.core.kv.interface import KVCacheManager, KVStats
from kvserve.core.kv.prefix_cache import PrefixCache, chain_hashes
from kvserve.request import Request

DROPPED = -1  # a table entry whose block the window gave back


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, windows: tuple[int, ...],
                 enable_prefix_caching: bool = True, step_tokens: int = 0) -> None:
        """``windows``: per group, 0 (full attention) or its window; ``step_tokens``: the
        most tokens one request computes in a step (sizes what a window holds)."""
        super().__init__(num_blocks, block_size)
        self.windows = windows
        self.step_tokens = step_tokens
        self.pool = BlockPool(num_blocks)
        self.cache = PrefixCache() if enable_prefix_caching else None
        self._tables: dict[str, list[list[int]]] = {}  # request -> a table per group
        self._tokens: dict[str, int] = {}
        self._hashes: dict[str, list[int]] = {}
        self._registered: dict[str, int] = {}

    # -- what each group keeps ---------------------------------------------------------

    def first_needed(self, group: int, computed: int) -> int:
        """The first block group ``group`` still reads once ``computed`` tokens are in
        the cache: the next token's window starts ``window - 1`` tokens before it."""
        window = self.windows[group]
        return max(0, computed - window + 1) // self.block_size if window else 0

    def _drop_outside(self, tables: list[list[int]], computed: int) -> None:
        for g, table in enumerate(tables):
            for j in range(min(self.first_needed(g, computed), len(table))):
                if table[j] != DROPPED:
                    self.pool.decref(table[j])
                    table[j] = DROPPED

    def max_request_tokens(self) -> int:
        """The longest sequence one request alone fits: a table as long as the sequence
        in every group, except that a windowed group's holds at most its window and a
        step's new tokens."""
        full = sum(1 for w in self.windows if not w)
        windowed = len(self.windows) - full
        reach = max(self.blocks_for(w - 1 + max(self.step_tokens, 1)) + 1
                    for w in self.windows if w)
        blocks = self.num_blocks // len(self.windows)  # every table equally long
        if blocks >= reach:
            blocks = max(blocks, (self.num_blocks - windowed * reach) // full)
        return blocks * self.block_size

    # -- prefix cache ------------------------------------------------------------------

    @staticmethod
    def _key(group: int, block_hash: int) -> int:
        return block_hash if group == 0 else hash((group, block_hash))

    def reset_prefix_cache(self) -> None:
        if self.cache is not None:
            queries, hits = self.cache.queries, self.cache.hits
            self.cache = PrefixCache()
            self.cache.queries, self.cache.hits = queries, hits

    def _cached_prefix(self, hashes: list[int]) -> int:
        """How many leading blocks hit: the full groups have each, the windowed groups
        those their window reads after them."""
        run = 0
        while run < len(hashes) and all(self.cache.lookup(self._key(g, hashes[run]))
                                        is not None
                                        for g, w in enumerate(self.windows) if not w):
            run += 1
        for k in range(run, 0, -1):
            if all(self.cache.lookup(self._key(g, hashes[j])) is not None
                   for g, w in enumerate(self.windows) if w
                   for j in range(self.first_needed(g, k * self.block_size), k)):
                return k
        return 0

    def get_computed_tokens(self, req: Request) -> int:
        if self.cache is None or req.request_id in self._tables:
            return 0
        full = (req.num_tokens - 1) // self.block_size  # its last token is computed
        hashes = chain_hashes(req.token_slice(0, full * self.block_size), self.block_size,
                              full, self._hashes.get(req.request_id, []), req.prefix_root)
        self._hashes[req.request_id] = hashes
        k = self._cached_prefix(hashes)
        tables = []
        for g in range(len(self.windows)):
            first = self.first_needed(g, k * self.block_size)
            table = [DROPPED] * first
            for j in range(first, k):
                block = self.cache.lookup(self._key(g, hashes[j]))
                self.pool.incref(block)
                table.append(block)
            tables.append(table)
        self._tables[req.request_id] = tables
        self._registered[req.request_id] = k
        cached = k * self.block_size
        if req.num_preemptions == 0:
            self.cache.queries += req.num_tokens
            self.cache.hits += cached
        self._tokens[req.request_id] = cached
        return cached

    def _register_full_blocks(self, req: Request, total: int) -> None:
        rid = req.request_id
        full = min(total, req.num_tokens) // self.block_size
        done = self._registered.get(rid, 0)
        if full <= done:
            return
        known = self._hashes.get(rid, [])
        if len(known) < full:
            known = self._hashes[rid] = chain_hashes(
                req.token_slice(0, full * self.block_size), self.block_size, full, known,
                req.prefix_root)
        for g, table in enumerate(self._tables[rid]):
            for j in range(done, full):
                if table[j] != DROPPED:
                    self.cache.register(self._key(g, known[j]), table[j])
        self._registered[rid] = full

    # -- allocation --------------------------------------------------------------------

    def _take(self, n: int) -> list[int]:
        blocks = self.pool.allocate(n)
        if self.cache is not None:
            for block in blocks:
                self.cache.evict(block)
        return blocks

    def _prompt_blocks(self, req: Request) -> int:
        """The most blocks ``req``'s prompt holds at once: every group's table to its
        end, a window's only its reach (chunks of ``step_tokens``)."""
        tokens = req.num_tokens
        return sum(self.blocks_for(tokens) if not w else
                   min(self.blocks_for(tokens), self.blocks_for(w - 1 + max(self.step_tokens, 1))
                       + 1) for w in self.windows)

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        rid = req.request_id
        computed = req.num_computed_tokens
        if rid not in self._tables and self._prompt_blocks(req) > self.pool.num_free:
            return False  # starting now, it would preempt itself before its prompt ends
        tables = self._tables.get(rid) or [[] for _ in self.windows]
        self._drop_outside(tables, computed)  # never read again, whatever happens next
        target = self.blocks_for(computed + num_new_tokens)
        grow = [(g, max(len(t), self.first_needed(g, computed)), target)
                for g, t in enumerate(tables)]
        if sum(max(0, end - start) for _, start, end in grow) > self.pool.num_free:
            if rid in self._tables:
                self._tables[rid] = tables
            return False
        for g, start, end in grow:
            table = tables[g]
            table += [DROPPED] * (start - len(table))
            if end > start:
                table += self._take(end - start)
        self._tables[rid] = tables
        self._tokens[rid] = computed + num_new_tokens
        if self.cache is not None:
            self._register_full_blocks(req, computed + num_new_tokens)
        return True

    def truncate(self, req: Request, num_tokens: int) -> None:
        tables = self._tables.get(req.request_id)
        if tables is None:
            return
        keep = self.blocks_for(num_tokens)
        for table in tables:
            for b in reversed(table[keep:]):
                if b != DROPPED:
                    self.pool.decref(b)
            del table[keep:]
        self._tokens[req.request_id] = min(self._tokens.get(req.request_id, 0), num_tokens)

    def free(self, req: Request) -> None:
        for table in self._tables.pop(req.request_id, []):
            for b in reversed(table):
                if b != DROPPED:
                    self.pool.decref(b)
        for held in (self._tokens, self._hashes, self._registered):
            held.pop(req.request_id, None)

    # -- views -------------------------------------------------------------------------

    def block_table(self, req: Request) -> list[int]:
        return self.group_tables(req)[0] if req.request_id in self._tables else []

    def group_tables(self, req: Request) -> list[list[int]]:
        """Each group's table, a dropped block as block 0 (masked, never read)."""
        return [[max(b, 0) for b in table] for table in self._tables.get(req.request_id, [])]

    def stats(self) -> KVStats:
        """Blocks held (shared ones once) and the token slots they fill."""
        filled: dict[int, int] = {}
        for rid, tables in self._tables.items():
            tokens = self._tokens.get(rid, 0)
            for table in tables:
                for j, b in enumerate(table):
                    if b != DROPPED:
                        n = min(self.block_size, max(0, tokens - j * self.block_size))
                        filled[b] = max(filled.get(b, 0), n)
        return KVStats(
            num_blocks=self.num_blocks, block_size=self.block_size,
            num_used_blocks=self.num_blocks - self.pool.num_free,
            used_tokens=sum(filled.values()), allocated_slots=len(filled) * self.block_size,
            prefix_queries=self.cache.queries if self.cache else 0,
            prefix_hits=self.cache.hits if self.cache else 0)

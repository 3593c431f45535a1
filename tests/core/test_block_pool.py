"""The block pool: refcounts, LRU free list, and block tables laid out for streaming."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.kv.block_pool import BlockPool
from kvserve.core.kv.paged import PagedKVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def _pool_freed_in(order: list[int], num_blocks: int) -> BlockPool:
    pool = BlockPool(num_blocks)
    taken = pool.allocate(num_blocks)
    assert taken == list(range(num_blocks))
    for b in order:
        pool.decref(b)
    return pool


def test_least_recently_freed_blocks_come_in_address_order():
    pool = _pool_freed_in([7, 3, 9, 1, 5, 0, 2, 4, 6, 8], 10)
    assert pool.allocate(4) == [1, 3, 7, 9]  # the four freed first, ascending
    assert pool.allocate(2) == [0, 5]
    assert pool.num_free == 4


def test_a_table_grows_into_the_blocks_after_its_last():
    pool = _pool_freed_in([9, 0, 3, 4, 6, 7, 8], 10)  # 1, 2 and 5 stay in use
    # 3 and 4 follow block 2 and are free, though 9 and 0 were freed before them
    assert pool.allocate(2, after=2) == [3, 4]
    # block 5 is in use: the least recently freed, in address order
    assert pool.allocate(3, after=4) == [0, 6, 9]
    assert pool.allocate(1, after=6) == [7]
    assert pool.allocate(1, after=9) == [8]  # no block after the pool's last
    assert pool.num_free == 0
    with pytest.raises(MemoryError, match="asked for 1 KV blocks, 0 free"):
        pool.allocate(1)


def test_a_used_neighbour_is_not_taken():
    pool = _pool_freed_in([5, 1], 6)
    assert pool.allocate(1, after=3) == [5]  # block 4 is in use: the LRU block instead
    assert pool.ref_counts[4] == 1 and pool.num_free == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6), st.integers(0, 1000)),
                min_size=1, max_size=60))
def test_no_block_is_handed_out_twice_or_lost(ops):
    """Random allocations (some growing a table, new ones leaving room) and frees: a
    block is free exactly when no table holds it, and every block is either free or held."""
    num_blocks = 24
    pool = BlockPool(num_blocks)
    tables: list[list[int]] = []
    for alloc, n, pick in ops:
        if alloc and n <= pool.num_free:
            grow = tables[pick % len(tables)] if tables and pick % 2 else None
            blocks = pool.allocate(n, grow[-1] if grow else None, room=pick % 5)
            if grow is not None:
                grow.extend(blocks)
            else:
                tables.append(blocks)
        elif tables:
            for b in reversed(tables.pop(pick % len(tables))):
                assert pool.decref(b)
        held = [b for t in tables for b in t]
        assert len(held) == len(set(held))
        assert pool.num_free + len(held) == num_blocks
        assert all((pool.ref_counts[b] == 0) == (b in pool._free) for b in range(num_blocks))


def test_a_growing_request_stays_consecutive_in_a_churned_pool():
    """After other requests came and went in random order, a decode that grows one block
    at a time still gets the blocks after its last ones, which decode attention streams
    with the hardware prefetcher (the kernel on shuffled tables: ~0.55x the bandwidth)."""
    bs = 4
    kv = PagedKVCacheManager(64, bs, enable_prefix_caching=False)
    rng = random.Random(0)
    others = [Request(f"o{i}", [1] * 16, SamplingParams(max_tokens=4), None, 4)
              for i in range(16)]
    for r in others:  # every block of the pool used once
        assert kv.allocate_slots(r, 16)
    assert kv.pool.num_free == 0
    rng.shuffle(others)
    for r in others:
        kv.free(r)
    req = Request("r", [2] * 8, SamplingParams(max_tokens=40), None, 40)
    assert kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    for _ in range(32):  # decode: one token a step
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    table = kv.block_table(req)
    assert table == sorted(table)
    assert table[2:] == list(range(table[2], table[2] + len(table) - 2))
    kv.free(req)
    assert kv.pool.num_free == 64


def test_new_tables_leave_room_to_grow_in_a_fresh_pool():
    pool = BlockPool(12)
    a = pool.allocate(2, room=3)
    b = pool.allocate(3, room=1)
    assert (a, b) == ([0, 1], [5, 6, 7])
    assert pool.allocate(2, after=a[-1]) == [2, 3]  # a grows into its room
    assert pool.allocate(1) == [9]  # the next new table starts after b's room
    assert pool.num_free == 12 - 8


def test_room_is_not_held_once_the_unused_blocks_run_out():
    pool = BlockPool(10)
    pool.allocate(2, room=3)  # 0-1, room 2-4
    pool.allocate(5)  # 5-9: the last never-used blocks
    assert pool.allocate(3) == [2, 3, 4]  # the room goes to whoever needs it
    assert pool.num_free == 0


def test_a_new_table_skips_unused_blocks_a_growing_table_took():
    pool = BlockPool(10)
    a = pool.allocate(2)  # 0-1, no room
    assert pool.allocate(2, after=a[-1]) == [2, 3]  # grows past where new tables start
    assert pool.allocate(2) == [4, 5]


def test_decoding_requests_of_a_fresh_pool_keep_consecutive_tables():
    """Requests prefilled one after another, then decoding in lockstep: each table grows
    into the room left after its prompt instead of taking blocks in turn with the others
    (which jumps at every block: ~0.7x the kernel's bandwidth on tables in order)."""
    bs = 4
    kv = PagedKVCacheManager(256, bs, enable_prefix_caching=False)
    reqs = [Request(f"r{i}", [i + 1] * (6 + i), SamplingParams(max_tokens=20), None, 20)
            for i in range(6)]
    for r in reqs:
        assert kv.allocate_slots(r, r.num_prompt_tokens)
        r.num_computed_tokens = r.num_prompt_tokens
    for _ in range(20):
        for r in reqs:
            assert kv.allocate_slots(r, 1)
            r.num_computed_tokens += 1
    for r in reqs:
        table = kv.block_table(r)
        assert table == list(range(table[0], table[0] + len(table)))
    for r in reqs:
        kv.free(r)
    assert kv.pool.num_free == 256


def test_a_swapped_in_request_gets_room_to_grow_too():
    kv = PagedKVCacheManager(64, 4, enable_prefix_caching=False, swap_slots=16)
    a = Request("a", [1] * 6, SamplingParams(max_tokens=10), None, 10)  # up to 4 blocks
    assert kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    assert kv.swap_out(a)
    kv.take_transfers()
    assert kv.swap_in(a, 1)
    a.num_computed_tokens = 7
    b = Request("b", [2] * 8, SamplingParams(max_tokens=4), None, 4)
    assert kv.allocate_slots(b, 8)
    assert kv.allocate_slots(a, 9)  # 16 tokens: all four blocks
    table = kv.block_table(a)
    assert table == list(range(table[0], table[0] + 4))
    assert not set(table) & set(kv.block_table(b))

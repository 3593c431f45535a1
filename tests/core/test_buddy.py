"""The buddy allocator and the buddy KV manager (xLLM's memory pool)."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.engine_args import EngineArgs
from kvserve.core.kv import create_kv_manager
from kvserve.core.kv.buddy import BuddyAllocator, BuddyKVCacheManager, order_for
from kvserve.model.attention import KVCache
from tests.core.kv_sim import make_request, simulate

BS = 4


# -- the allocator ---------------------------------------------------------------------------


def test_pool_of_any_size_starts_as_aligned_power_of_two_chunks():
    assert BuddyAllocator(100).free_chunks() == [(0, 6), (64, 5), (96, 2)]
    assert BuddyAllocator(64).free_chunks() == [(0, 6)]
    assert BuddyAllocator(1).free_chunks() == [(0, 0)]
    BuddyAllocator(100).check()


def test_split_then_coalesce():
    b = BuddyAllocator(16)
    start = b.alloc(0)
    assert start == 0
    # splitting 16 for one block leaves one free chunk of each smaller order
    assert b.free_chunks() == [(1, 0), (2, 1), (4, 2), (8, 3)]
    b.check()
    b.free(start)
    assert b.free_chunks() == [(0, 4)]


def test_lowest_address_first_and_no_merge_across_non_buddies():
    b = BuddyAllocator(16)
    runs = [b.alloc(2) for _ in range(4)]
    assert runs == [0, 4, 8, 12]
    assert b.alloc(0) is None
    b.free(4)
    b.free(8)  # 4 and 8 are adjacent but not buddies: no order-3 chunk
    assert b.free_chunks() == [(4, 2), (8, 2)]
    assert b.alloc(3) is None
    b.free(0)
    assert b.free_chunks() == [(0, 3), (8, 2)]
    b.check()


def test_merge_up_and_down():
    b = BuddyAllocator(16)
    lo, hi = b.alloc(2), b.alloc(2)          # 0 and 4
    b.free(lo)
    assert b.can_merge(hi, 3)                 # its lower buddy is free
    assert b.merge(hi, 3) == 0                # the run now starts lower
    assert not b.can_merge(0, 5)              # beyond the pool
    assert b.can_merge(0, 4)
    assert b.merge(0, 4) == 0
    assert b.free_chunks() == []
    b.check()


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 70), st.lists(st.tuples(st.sampled_from("afg"), st.integers(0, 7),
                                            st.integers(0, 10_000)), max_size=60))
def test_any_sequence_keeps_invariants_and_returns_all_memory(n, ops):
    b = BuddyAllocator(n)
    initial = b.free_chunks()
    runs: dict[int, int] = {}
    for kind, order, pick in ops:
        if kind == "a":
            start = b.alloc(order)
            if start is None:
                assert order > (b.largest_free_order() if b.num_free else -1)
            else:
                assert start % (1 << order) == 0 and start + (1 << order) <= n
                runs[start] = order
        elif runs and kind == "f":
            start = sorted(runs)[pick % len(runs)]
            b.free(start)
            del runs[start]
        elif runs:  # grow: take buddies, else move
            start = sorted(runs)[pick % len(runs)]
            new_order = runs[start] + 1 + order % 2
            if b.can_merge(start, new_order):
                new = b.merge(start, new_order)
                assert new <= start < new + (1 << new_order)
                del runs[start]
                runs[new] = new_order
            else:
                new = b.alloc(new_order)
                if new is not None:
                    b.free(start)
                    del runs[start]
                    runs[new] = new_order
        b.check()
        assert b.allocated == runs
        blocks = [i for s, k in runs.items() for i in range(s, s + (1 << k))]
        assert len(blocks) == len(set(blocks)), "runs overlap"
        assert b.num_free + len(blocks) == n
    for start in list(runs):
        b.free(start)
    b.check()
    assert b.num_free == n
    assert b.free_chunks() == initial


def test_order_for():
    assert [order_for(n) for n in (0, 1, 2, 3, 4, 5, 8, 9)] == [0, 0, 1, 2, 2, 3, 3, 4]


# -- the manager -------------------------------------------------------------------------------


def _req(rid, prompt_len, max_tokens=8):
    return make_request(rid, list(range(1, prompt_len + 1)), max_tokens)


def _grow(kv, req, new_tokens):
    ok = kv.allocate_slots(req, new_tokens)
    if ok:
        req.num_computed_tokens += new_tokens
    return ok


def test_grow_in_place_takes_the_upper_buddy_without_copies():
    kv = BuddyKVCacheManager(16, BS)
    a = _req("a", 8)
    assert _grow(kv, a, 8)                       # 2 blocks: run [0, 2)
    assert kv.block_table(a) == [0, 1]
    assert _grow(kv, a, 5)                       # 13 tokens, 4 blocks: buddy [2, 4) taken
    assert kv.block_table(a) == [0, 1, 2, 3]
    assert kv.take_block_copies() == []
    assert kv.stats().moved_blocks == 0


def test_upper_half_run_merges_down_and_copies_its_blocks():
    kv = BuddyKVCacheManager(16, BS)
    a, b = _req("a", 8), _req("b", 8)
    assert _grow(kv, a, 8) and _grow(kv, b, 8)   # a [0, 2), b [2, 4)
    kv.free(a)
    assert _grow(kv, b, 1)                       # 9 tokens: 3 blocks, order 2 = [0, 4)
    assert kv.block_table(b) == [0, 1, 2]
    assert kv.take_block_copies() == [(2, 0), (3, 1)]
    assert kv.stats().moved_blocks == 2


def test_move_to_a_larger_run_copies_and_frees_the_old_one():
    kv = BuddyKVCacheManager(16, BS)
    a, b = _req("a", 8), _req("b", 8)
    assert _grow(kv, a, 8) and _grow(kv, b, 8)   # a [0, 2), b [2, 4): a's buddy is taken
    assert _grow(kv, a, 1)                       # a moves to [4, 8)
    assert kv.block_table(a) == [4, 5, 6]
    assert kv.take_block_copies() == [(0, 4), (1, 5)]
    assert kv.buddy.free_chunks() == [(0, 1), (8, 3)]
    assert kv.stats().moved_blocks == 2


def test_failed_growth_changes_nothing():
    kv = BuddyKVCacheManager(8, BS)
    a, b = _req("a", 16), _req("b", 8)
    assert _grow(kv, a, 16) and _grow(kv, b, 8)  # a [0, 4), b [4, 6)
    def state():
        s = kv.stats()
        return (s.num_used_blocks, s.used_tokens, s.allocated_slots, s.moved_blocks,
                kv.block_table(a), kv.buddy.free_chunks())
    before = state()
    assert not kv.allocate_slots(a, 1)           # needs 8 blocks, b is in the way
    assert state() == before
    assert kv.stats().unusable_free_blocks == 2  # the 2 free blocks cannot serve order 3
    assert kv.take_block_copies() == []
    kv.free(b)
    assert _grow(kv, a, 1)                       # now the whole pool is a's
    assert kv.block_table(a) == [0, 1, 2, 3, 4]


def test_freeing_a_request_drops_its_planned_moves():
    kv = BuddyKVCacheManager(16, BS)
    a, b = _req("a", 8), _req("b", 8)
    assert _grow(kv, a, 8) and _grow(kv, b, 8)
    assert _grow(kv, a, 1)                       # move planned: (0, 4), (1, 5)
    kv.free(a)
    assert kv.take_block_copies() == []


def test_stats_and_external_fragmentation():
    kv = BuddyKVCacheManager(16, BS)
    reqs = [_req(str(i), 8) for i in range(8)]   # 8 runs of 2 blocks fill the pool
    for r in reqs:
        assert _grow(kv, r, 6)                   # 6 tokens in 2 blocks
    for r in reqs[::2]:
        kv.free(r)                               # 4 free runs of 2, none coalesce
    assert not kv.allocate_slots(_req("big", 16), 16)  # asks for order 2: 4 blocks
    s = kv.stats()
    assert (s.num_used_blocks, s.used_tokens, s.allocated_slots) == (8, 24, 32)
    assert s.utilization == 0.75
    assert s.unusable_free_blocks == 8           # every free block is in a run too small
    assert s.external_fragmentation == 1.0


def test_memory_pool_ratio_and_largest_request():
    args = EngineArgs(kv_manager="buddy", block_size=BS, memory_pool_ratio=0.5)
    kv = create_kv_manager(args.create_cache_config(), 100)
    assert isinstance(kv, BuddyKVCacheManager)
    assert kv.num_blocks == 50                   # 32 + 16 + 2
    assert kv.max_request_tokens() == 32 * BS
    assert kv.stats().num_blocks == 50


def test_runner_copies_read_every_source_before_writing():
    """A move's source freed and taken as another move's destination in the same step:
    (0 -> 4) then (2 -> 0) must give 4 the old 0, not the old 2."""
    cache = KVCache(6, 2, 1, 1, torch.float32)
    cache.k[:, :, 0, 0] = torch.arange(6.0)[:, None]
    cache.copy_blocks(torch.tensor([0, 2]), torch.tensor([4, 0]))
    assert cache.k[4, 0, 0, 0] == 0 and cache.k[0, 0, 0, 0] == 2


# -- whole runs through the real scheduler, KV contents checked every step --------------------


@pytest.mark.parametrize("batching", ["continuous", "length-bucket", "static"])
def test_scheduler_runs_keep_kv_contents_right(batching):
    rng = random.Random(1)
    reqs = [make_request(str(i), [rng.randrange(1000) for _ in range(rng.randint(1, 60))],
                         rng.randint(1, 30), arrival=i * 1e-3) for i in range(30)]
    args = EngineArgs(kv_manager="buddy", batching=batching, block_size=BS,
                      max_num_batched_tokens=32, max_batch_size=4, bucket_window_s=0.0)
    res = simulate(args, 48, reqs)
    assert res.moved_blocks > 0
    assert res.same_step_reuse > 0, "no step reused a moved run's blocks: weak test"
    if batching != "static":
        assert res.preemptions > 0


@settings(max_examples=40, deadline=None)
@given(st.integers(16, 80), st.sampled_from([1, 2, 4, 8]), st.integers(4, 64),
       st.lists(st.tuples(st.integers(1, 50), st.integers(1, 20)), min_size=1, max_size=14),
       st.sampled_from(["continuous", "length-bucket", "static"]), st.floats(0.3, 1.0))
def test_any_workload_gives_right_kv_and_returns_all_memory(num_blocks, bs, budget, shapes,
                                                            batching, ratio):
    args = EngineArgs(kv_manager="buddy", batching=batching, block_size=bs,
                      max_num_batched_tokens=budget, max_batch_size=3, bucket_window_s=0.0,
                      memory_pool_ratio=ratio)
    pool_tokens = (1 << (max(1, int(num_blocks * ratio)).bit_length() - 1)) * bs
    reqs = [make_request(str(i), [(7 * i + j) % 1000 for j in range(p)], m, arrival=i)
            for i, (p, m) in enumerate(shapes) if p + m <= pool_tokens]
    simulate(args, num_blocks, reqs)

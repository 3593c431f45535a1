"""The contiguous manager (HF static baseline): whole length reserved up front."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.engine_args import EngineArgs
from kvserve.core.kv import create_kv_manager
from kvserve.core.kv.contiguous import ContiguousKVCacheManager
from tests.core.kv_sim import make_request, simulate

BS = 4


def _req(rid, prompt_len, max_tokens):
    return make_request(rid, list(range(1, prompt_len + 1)), max_tokens)


def _step(kv, req, n):
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n


def test_reserves_prompt_plus_max_tokens_and_never_grows():
    kv = create_kv_manager(EngineArgs(kv_manager="contiguous", block_size=BS).create_cache_config(), 32)
    assert isinstance(kv, ContiguousKVCacheManager)
    a = _req("a", 5, 10)                        # 15 tokens: 4 blocks reserved
    _step(kv, a, 5)
    assert kv.block_table(a) == [0, 1]
    s = kv.stats()
    assert (s.num_used_blocks, s.used_tokens, s.allocated_slots) == (4, 5, 16)
    for _ in range(9):
        _step(kv, a, 1)
    assert kv.block_table(a) == [0, 1, 2, 3]
    assert kv.stats().num_used_blocks == 4 and kv.stats().used_tokens == 14
    kv.free(a)
    kv.free(a)                                  # unknown: a no-op
    assert kv.stats().num_used_blocks == 0


def test_first_fit_holes_and_external_fragmentation():
    kv = ContiguousKVCacheManager(16, BS)
    reqs = [_req(str(i), 4, 12) for i in range(4)]   # 16 tokens: 4 blocks each
    for r in reqs:
        _step(kv, r, 4)
    assert [kv.block_table(r)[0] for r in reqs] == [0, 4, 8, 12]
    kv.free(reqs[0])
    kv.free(reqs[2])                           # holes [0, 4) and [8, 12): 8 free blocks
    big = _req("big", 20, 4)                   # needs 6 contiguous blocks
    before = kv.stats()
    assert not kv.allocate_slots(big, 20)
    s = kv.stats()
    assert (s.num_used_blocks, s.used_tokens) == (before.num_used_blocks, before.used_tokens)
    assert s.unusable_free_blocks == 8 and s.external_fragmentation == 1.0
    small = _req("small", 2, 6)                # 2 blocks: first fit, the lowest hole
    _step(kv, small, 2)
    assert kv.block_table(small) == [0]
    assert kv.holes() == [(2, 2), (8, 4)]


def test_largest_request_is_the_whole_pool():
    kv = ContiguousKVCacheManager(10, BS)
    assert kv.max_request_tokens() == 40
    a = _req("a", 30, 10)
    _step(kv, a, 30)
    assert kv.stats().num_used_blocks == 10


@pytest.mark.parametrize("batching", ["continuous", "length-bucket", "static"])
def test_scheduler_runs_keep_kv_contents_right(batching):
    rng = random.Random(2)
    reqs = [make_request(str(i), [rng.randrange(1000) for _ in range(rng.randint(1, 60))],
                         rng.randint(1, 30), arrival=i * 1e-3) for i in range(30)]
    args = EngineArgs(kv_manager="contiguous", batching=batching, block_size=BS,
                      max_num_batched_tokens=32, max_batch_size=4, bucket_window_s=0.0)
    res = simulate(args, 40, reqs)
    assert res.preemptions == 0                # a reservation never needs to grow


@settings(max_examples=30, deadline=None)
@given(st.integers(8, 60), st.sampled_from([1, 4, 8]), st.integers(4, 64),
       st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=12),
       st.sampled_from(["continuous", "length-bucket", "static"]))
def test_any_workload_gives_right_kv_and_returns_all_memory(num_blocks, bs, budget, shapes,
                                                            batching):
    args = EngineArgs(kv_manager="contiguous", batching=batching, block_size=bs,
                      max_num_batched_tokens=budget, max_batch_size=3, bucket_window_s=0.0)
    reqs = [make_request(str(i), [(5 * i + j) % 1000 for j in range(p)], m, arrival=i)
            for i, (p, m) in enumerate(shapes) if p + m <= num_blocks * bs]
    simulate(args, num_blocks, reqs)

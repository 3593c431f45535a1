"""Paged memory with a table per KV group: windowed groups give back the blocks their
window no longer reads, the full group keeps the sequence, prefix hits need each
window's last blocks, and nothing leaks; the real scheduler over it reads only the KV
each window should see (kv_sim)."""
from __future__ import annotations

import random

import pytest

from kvserve.core.kv.groups import kv_groups
from kvserve.core.kv.hybrid import HybridKVCacheManager
from kvserve.core.kv.prefix_cache import chain_hashes
from kvserve.engine.engine_args import EngineArgs
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from tests.core.kv_sim import make_request, simulate

BS = 4


def _req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), eos_token_id=None,
                   max_tokens=max_tokens)


def _held(kv: HybridKVCacheManager, req: Request) -> list[int]:
    return [sum(b >= 0 for b in t) for t in kv._tables[req.request_id]]


def test_groups_of_gemma_like_layers():
    g2 = kv_groups((4096, 0) * 13, None)  # Gemma 2: local and global layers alternate
    assert g2.windows == (0, 4096) and g2.slots == 13
    g3 = kv_groups(((512,) * 5 + (0,)) * 4 + (512, 512), None)  # Gemma 3: five to one
    assert g3.windows == (0, 512, 512, 512, 512, 512, 512) and g3.slots == 4
    assert sorted(zip(g3.layer_group, g3.layer_slot)) == sorted(set(zip(g3.layer_group,
                                                                        g3.layer_slot)))
    assert kv_groups((0, 0), None) is None and kv_groups((8, 8), None) is None
    assert kv_groups((8, 0), 16) is None  # the model windows every layer itself


def test_a_window_gives_back_blocks_as_the_sequence_grows():
    kv = HybridKVCacheManager(64, BS, (0, 8))
    req = _req("a", list(range(20)), max_tokens=20)
    assert kv.allocate_slots(req, 20)
    req.num_computed_tokens = 20
    assert _held(kv, req) == [5, 5]  # the prompt's chunk is written by both groups
    for _ in range(12):
        req.output_token_ids.append(1)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    # 32 tokens: the next one reads back to position 25, block 6 on
    assert _held(kv, req) == [8, 2] and kv.pool.num_free == 64 - 10
    assert kv.group_tables(req)[1][:6] == [0] * 6
    kv.free(req)
    assert kv.stats().num_used_blocks == 0


def test_a_prefix_hit_needs_the_windows_last_blocks():
    kv = HybridKVCacheManager(64, BS, (0, 8))
    prompt = list(range(24))
    a = _req("a", prompt)
    assert kv.allocate_slots(a, 24)
    a.num_computed_tokens = 24
    kv.free(a)
    b = _req("b", prompt + [99])
    assert kv.get_computed_tokens(b) == 24  # full group 6 blocks, window blocks 4 and 5
    assert [sum(x >= 0 for x in t) for t in kv._tables["b"]] == [6, 2]
    kv.free(b)
    # the window's copy of the last block evicted: the hit falls back to where each
    # block the window reads is still cached
    hashes = chain_hashes(prompt, BS, 6, [])
    kv.cache.evict(kv.cache.lookup(kv._key(1, hashes[5])))
    c = _req("c", prompt + [98])
    assert kv.get_computed_tokens(c) == 20
    assert [sum(x >= 0 for x in t) for t in kv._tables["c"]] == [5, 2]
    kv.free(c)
    assert kv.stats().num_used_blocks == 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching", [True, False])
def test_the_scheduler_over_groups_reads_each_windows_kv_and_leaks_nothing(seed, caching):
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(rng.randrange(4, 30))]
    reqs = []
    for i in range(rng.randrange(6, 14)):
        prompt = (shared if rng.random() < 0.5 else []) + [
            rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        reqs.append(make_request(f"r{i}", prompt, rng.randrange(1, 30)))
    args = EngineArgs(block_size=BS, max_num_batched_tokens=rng.choice([8, 16, 64]),
                      max_num_seqs=rng.choice([2, 4, 8]), enable_prefix_caching=caching)
    windows = rng.choice([(0, 6), (0, 9, 9), (0, 5, 13)])
    res = simulate(args, rng.choice([40, 60, 200]), reqs, windows=windows)
    assert all(len(res.outputs[r.request_id]) == r.max_tokens for r in reqs)

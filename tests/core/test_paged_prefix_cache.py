"""The paged manager with prefix caching: sharing, LRU eviction, no leaks."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.kv.paged import PagedKVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), eos_token_id=None,
                   max_tokens=8)


def _admit(kv: PagedKVCacheManager, req: Request) -> bool:
    req.num_computed_tokens = kv.get_computed_tokens(req)
    ok = kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    if ok:
        req.num_computed_tokens = req.num_tokens
    else:
        kv.free(req)
        req.num_computed_tokens = 0
    return ok


def test_shared_prefix_reuses_full_blocks():
    kv = PagedKVCacheManager(32, BS)
    a = _req("a", list(range(10)))        # blocks [0-3][4-7] full, [8,9] partial
    assert _admit(kv, a)
    b = _req("b", list(range(8)) + [50, 51, 52])
    assert kv.get_computed_tokens(b) == 8
    assert kv.block_table(b) == kv.block_table(a)[:2]
    assert kv.pool.ref_counts[kv.block_table(a)[0]] == 2


def test_whole_prompt_never_fully_cached():
    kv = PagedKVCacheManager(32, BS)
    a = _req("a", list(range(8)))
    assert _admit(kv, a)
    kv.free(a)
    b = _req("b", list(range(8)))
    assert kv.get_computed_tokens(b) == 4  # the last block holds the last token: computed


def test_prompt_tail_is_copied_from_a_live_request():
    kv = PagedKVCacheManager(32, BS)
    a = _req("a", list(range(10)))  # [0-3][4-7] full, [8,9] part-filled
    assert _admit(kv, a)
    b = _req("b", list(range(10)))
    assert kv.get_computed_tokens(b) == 9  # all but the last token, which b computes
    ta, tb = kv.block_table(a), kv.block_table(b)
    assert tb[:2] == ta[:2] and tb[2] != ta[2]  # full blocks shared, the tail copied
    assert kv.take_block_copies() == [(ta[2], tb[2])]
    assert kv.allocate_slots(b, 1)
    kv.free(a)
    kv.free(b)
    assert kv.stats().num_used_blocks == 0 and not kv._tail_owner


def test_no_tail_copy_before_the_donor_has_computed_it():
    kv = PagedKVCacheManager(32, BS)
    a = _req("a", list(range(10)))
    a.num_computed_tokens = kv.get_computed_tokens(a)
    assert kv.allocate_slots(a, 10)  # scheduled in this step, not computed yet
    b = _req("b", list(range(10)))
    assert kv.get_computed_tokens(b) == 8  # same-step full-block hits only
    assert kv.take_block_copies() == []


def test_tail_copy_dropped_when_admission_is_undone():
    kv = PagedKVCacheManager(32, BS)
    assert _admit(kv, _req("a", list(range(10))))
    b = _req("b", list(range(10)))
    assert kv.get_computed_tokens(b) == 9
    kv.free(b)  # e.g. max_num_seqs reached: the scheduler drops what b took
    assert kv.take_block_copies() == []
    assert kv.stats().num_used_blocks == 3


def test_freed_blocks_stay_cached_until_reused():
    kv = PagedKVCacheManager(4, BS)
    a = _req("a", list(range(9)))
    assert _admit(kv, a)
    kv.free(a)
    assert kv.stats().num_used_blocks == 0
    b = _req("b", list(range(9)))
    assert kv.get_computed_tokens(b) == 8  # hit after a was freed
    kv.free(b)
    c = _req("c", [100 + i for i in range(16)])  # needs all 4 blocks: evicts the cache
    assert _admit(kv, c)
    kv.free(c)
    d = _req("d", list(range(9)))
    assert kv.get_computed_tokens(d) == 0


def test_lru_evicts_least_recently_freed_first():
    kv = PagedKVCacheManager(6, BS)
    a, b = _req("a", list(range(5))), _req("b", list(range(100, 105)))
    assert _admit(kv, a) and _admit(kv, b)
    kv.free(a)
    kv.free(b)
    c = _req("c", [200 + i for i in range(8)])  # needs 2 blocks: the 2 never-used ones
    assert _admit(kv, c)
    d = _req("d", [300 + i for i in range(8)])  # 2 more: a's freed first, so a's go
    assert _admit(kv, d)
    assert kv.get_computed_tokens(_req("a2", list(range(5)))) == 0
    assert kv.get_computed_tokens(_req("b2", list(range(100, 105)))) == 4


def test_hit_counters():
    kv = PagedKVCacheManager(32, BS)
    assert _admit(kv, _req("a", list(range(12))))
    assert _admit(kv, _req("b", list(range(12))))
    s = kv.stats()
    assert s.prefix_queries == 24 and s.prefix_hits == 8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 7),
                          st.integers(1, 20), st.integers(0, 2)), max_size=40))
def test_random_requests_never_leak(ops):
    """Any sequence of admissions, growth and frees keeps refcounts exact."""
    kv = PagedKVCacheManager(24, BS)
    prefixes = [list(range(12)), list(range(50, 62)), list(range(90, 96))]
    live: dict[str, Request] = {}
    for n, (op, slot, length, prefix) in enumerate(ops):
        rid = f"r{slot}"
        if op == "add" and rid not in live:
            req = _req(rid, prefixes[prefix][:length] + [200 + n] * max(0, length - 12))
            if _admit(kv, req):
                live[rid] = req
        elif op == "grow" and rid in live:
            req = live[rid]
            req.output_token_ids.append(300 + n)
            if kv.allocate_slots(req, 1):
                req.num_computed_tokens += 1
            else:
                req.output_token_ids.pop()
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        expected = [0] * kv.num_blocks
        for req in live.values():
            table = kv.block_table(req)
            assert len(table) == kv.blocks_for(req.num_computed_tokens)
            for b in table:
                expected[b] += 1
        assert expected == kv.pool.ref_counts
        assert kv.pool.num_free == expected.count(0)
    for req in live.values():
        kv.free(req)
    assert kv.stats().num_used_blocks == 0 and all(rc == 0 for rc in kv.pool.ref_counts)

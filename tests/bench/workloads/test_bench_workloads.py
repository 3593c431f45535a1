"""Workloads: deterministic, in range, special ids excluded; Poisson arrivals seeded."""

from __future__ import annotations

import math
import statistics

import pytest

from kvserve.bench.workloads.definitions import (
    make_workload,
    mixed_workload,
    poisson_arrival_times,
    random_workload,
    shared_prefix_workload,
)

SPECIAL = [0, 1, 5, 99]


def test_mixed_shape_ranges_and_determinism() -> None:
    wl = mixed_workload(100, SPECIAL)
    assert wl.name == "mixed" and len(wl) == 128 and wl.seed == 0
    for r in wl.requests:
        assert 16 <= r.prompt_len <= 512
        assert 16 <= r.max_tokens <= 256
        assert all(0 <= t < 100 and t not in SPECIAL for t in r.prompt_token_ids)
    again = mixed_workload(100, SPECIAL)
    assert again.requests == wl.requests
    assert mixed_workload(100, SPECIAL, seed=1).requests != wl.requests
    # lengths really vary across the whole range
    plens = [r.prompt_len for r in wl.requests]
    assert max(plens) - min(plens) > 300


def test_mixed_prefix_stable_under_num_requests() -> None:
    full = mixed_workload(100, SPECIAL)
    assert mixed_workload(100, SPECIAL, num_requests=10).requests == full.requests[:10]


def test_shared_prefix() -> None:
    wl = shared_prefix_workload(50, SPECIAL)
    assert len(wl) == 64
    prefix = wl.requests[0].prompt_token_ids[:384]
    for r in wl.requests:
        assert r.prompt_len == 416 and r.max_tokens == 32
        assert r.prompt_token_ids[:384] == prefix
        assert not set(r.prompt_token_ids) & set(SPECIAL)
    uniques = {tuple(r.prompt_token_ids[384:]) for r in wl.requests}
    assert len(uniques) == 64
    assert wl.describe()["prompt_tokens"] == 64 * 416


def test_shared_prefix_with_several_prefixes_interleaves_them() -> None:
    wl = shared_prefix_workload(50, SPECIAL, num_requests=60, num_prefixes=3)
    prefixes = [tuple(r.prompt_token_ids[:384]) for r in wl.requests]
    assert len(set(prefixes)) == 3
    assert all(prefixes.count(p) >= 10 for p in set(prefixes))
    assert len({prefixes[i] for i in range(0, 60, 2)}) == 3  # not one prefix per parity
    assert wl.describe()["num_prefixes"] == 3
    assert make_workload("shared-prefix", 50, num_prompts=6, num_prefixes=2).requests == \
        shared_prefix_workload(50, num_requests=6, num_prefixes=2).requests
    with pytest.raises(ValueError, match="shared-prefix workload only"):
        make_workload("mixed", 50, num_prefixes=2)


def test_random_and_make_workload() -> None:
    wl = make_workload("random", 30, [0], num_prompts=5, input_len=7, output_len=3)
    assert [(r.prompt_len, r.max_tokens) for r in wl.requests] == [(7, 3)] * 5
    assert wl.num_output_tokens == 15 and wl.num_prompt_tokens == 35
    assert make_workload("mixed", 30, [0], num_prompts=4).requests == mixed_workload(30, [0]).requests[:4]
    assert len(make_workload("shared-prefix", 30, num_prompts=3, output_len=5)) == 3
    assert random_workload(30, seed=2).requests == random_workload(30, seed=2).requests
    with pytest.raises(ValueError):
        make_workload("mixed", 30, input_len=5)
    with pytest.raises(ValueError):
        make_workload("nope", 30)
    with pytest.raises(ValueError):
        mixed_workload(3, [0, 1, 2])


def test_poisson_arrivals() -> None:
    a = poisson_arrival_times(2000, 4.0, seed=0)
    assert a == poisson_arrival_times(2000, 4.0, seed=0)
    assert a != poisson_arrival_times(2000, 4.0, seed=1)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)
    assert poisson_arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert poisson_arrival_times(0, 1.0) == []
    with pytest.raises(ValueError):
        poisson_arrival_times(3, 0.0)

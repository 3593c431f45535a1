"""Batching policies (continuous, length-bucket, static) and priority scheduling."""
from __future__ import annotations

import random
import time

import pytest

from kvserve.engine.engine_args import EngineArgs
from kvserve.core.batching import (ContinuousBatching, LengthBucketBatching, StaticBatching,
                                   length_bucket)
from kvserve.core.kv import create_kv_manager
from kvserve.core.scheduler import Scheduler
from kvserve.request import RequestStatus
from tests.core.kv_sim import make_request, simulate


def _reqs(lengths, t0=0.0, dt=1.0):
    return [make_request(str(i), [5] * n, 4, arrival=t0 + i * dt) for i, n in enumerate(lengths)]


def _ids(reqs):
    return [r.request_id for r in reqs]


# -- the policies alone ------------------------------------------------------------------------


def test_continuous_admits_everything_in_queue_order():
    reqs = _reqs([3, 100, 7])
    assert ContinuousBatching().admissible(reqs, now=0.0) == reqs


def test_length_buckets_are_powers_of_two():
    assert [length_bucket(n) for n in (1, 2, 16, 17, 32, 33, 512, 513)] == [
        0, 1, 4, 5, 5, 6, 9, 10]


def test_length_bucket_releases_a_full_bucket_at_once():
    policy = LengthBucketBatching(max_batch_size=2, window_s=10.0)
    reqs = _reqs([20, 200, 30, 300])            # buckets: (16,32] x2, (128,256], (256,512]
    assert _ids(policy.admissible(reqs, now=3.0)) == ["0", "2"]


def test_length_bucket_releases_a_bucket_whose_oldest_waited_the_window():
    policy = LengthBucketBatching(max_batch_size=4, window_s=5.0)
    reqs = _reqs([20, 200, 30, 300])            # arrivals 0, 1, 2, 3
    assert policy.admissible(reqs, now=4.9) == []
    assert _ids(policy.admissible(reqs, now=5.5)) == ["0", "2"]   # oldest of (16, 32] is 0
    assert _ids(policy.admissible(reqs, now=6.0)) == ["0", "1", "2"]


def test_length_bucket_batches_are_at_most_max_batch_size_and_stay_released():
    policy = LengthBucketBatching(max_batch_size=2, window_s=100.0)
    reqs = _reqs([20, 21, 22, 23, 24])
    assert _ids(policy.admissible(reqs, now=0.0)) == ["0", "1"]
    # "0" admitted; "1" did not fit in memory: it stays released, no new batch yet
    reqs[0].status = RequestStatus.RUNNING
    waiting = reqs[1:]
    assert _ids(policy.admissible(waiting, now=0.1)) == ["1", "2", "3"]


def test_length_bucket_puts_preempted_requests_first():
    policy = LengthBucketBatching(max_batch_size=8, window_s=100.0)
    reqs = _reqs([20, 200])
    reqs[1].status = RequestStatus.PREEMPTED
    assert _ids(policy.admissible(reqs, now=0.0)) == ["1"]


def test_static_admits_nothing_new_until_the_batch_is_done():
    policy = StaticBatching(max_batch_size=2)
    reqs = _reqs([5, 6, 7, 8])
    assert _ids(policy.admissible(reqs, now=0.0)) == ["0", "1"]
    reqs[0].status = RequestStatus.RUNNING
    assert _ids(policy.admissible(reqs[1:], now=0.0)) == ["1"]
    reqs[1].status = RequestStatus.RUNNING
    assert policy.admissible(reqs[2:], now=0.0) == []
    reqs[0].status = RequestStatus.FINISHED_LENGTH
    assert policy.admissible(reqs[2:], now=0.0) == []
    reqs[1].status = RequestStatus.FINISHED_ABORTED
    assert _ids(policy.admissible(reqs[2:], now=0.0)) == ["2", "3"]


# -- through the scheduler -------------------------------------------------------------------


def _run(args, num_blocks, reqs, on_step):
    kv = create_kv_manager(args.create_cache_config(), num_blocks)
    sched = Scheduler(args.create_scheduler_config(), kv)
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished():
        out = sched.schedule()
        on_step(sched, out)
        sched.update(out, {s.request_id: 3 for s in out.scheduled if s.sample})
    return sched


@pytest.mark.parametrize("kv_manager", ["paged", "buddy", "contiguous"])
def test_static_batches_run_to_completion_before_the_next(kv_manager):
    rng = random.Random(0)
    reqs = [make_request(str(i), [1] * rng.randint(1, 30), rng.randint(1, 12), arrival=i)
            for i in range(10)]
    args = EngineArgs(kv_manager=kv_manager, batching="static", max_batch_size=4,
                      block_size=4, max_num_batched_tokens=64)
    seen_batches: list[set[str]] = []
    peak = []

    def on_step(sched, out):
        running = {r.request_id for r in sched.running}
        assert len(running) <= 4 and out.stats.num_running == len(running)
        peak.append(out.stats.num_running)
        if not seen_batches or not running <= seen_batches[-1]:
            seen_batches.append(running)
    _run(args, 64, reqs, on_step)
    assert [sorted(b, key=int) for b in seen_batches] == [
        ["0", "1", "2", "3"], ["4", "5", "6", "7"], ["8", "9"]]
    assert max(peak) == 4


def test_length_bucket_in_the_scheduler_waits_for_a_full_bucket_or_the_window():
    lengths = [20, 300, 25, 100, 30]            # (16, 32] fills a batch of 3; 300, 100 alone
    soon = time.monotonic() + 3600               # arrival in the future: no window elapsed
    reqs = [make_request(str(i), list(range(i * 1000, i * 1000 + n)), 2, arrival=soon)
            for i, n in enumerate(lengths)]
    args = EngineArgs(batching="length-bucket", max_batch_size=3, bucket_window_s=1.0,
                      max_num_batched_tokens=2048)
    sched = Scheduler(args.create_scheduler_config(), create_kv_manager(args.create_cache_config(), 256))
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["0", "2", "4"]
    sched.update(out, {s.request_id: 3 for s in out.scheduled})
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled if s.start_pos == 0] == []
    sched.update(out, {s.request_id: 3 for s in out.scheduled})
    for r in reqs:
        r.arrival_time -= 7200                   # now they have waited an hour
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled if s.start_pos == 0] == ["1", "3"]


def test_each_step_carries_the_stats_it_was_scheduled_with():
    args = EngineArgs(max_num_seqs=3, block_size=4)
    seen = []

    def on_step(sched, out):
        seen.append(out.stats)
        assert out.stats.num_running == len(sched.running)
        assert out.stats.num_waiting == len(sched.waiting)
        assert out.stats.num_scheduled_tokens == out.num_tokens
        assert out.stats.kv == sched.kv.stats()  # nothing changed since it was taken
    _run(args, 64, _reqs([4, 4, 4, 4, 4]), on_step)
    assert max(s.num_running for s in seen) == 3
    assert seen[0].num_waiting == 2 and seen[0].num_scheduled_tokens == 12
    assert all(s.kv.num_blocks == 64 for s in seen)


# -- priority ------------------------------------------------------------------------------


def _prio_req(rid, n, prio, arrival, max_tokens=6):
    return make_request(rid, [1] * n, max_tokens, arrival=arrival, priority=prio)


@pytest.mark.parametrize("kv_manager,victims", [
    ("paged", ["low-new"]),
    ("contiguous", ["low-new"]),
    ("buddy", ["low-new", "low-old"]),         # "high" needs a run of 8: the whole pool
])
def test_priority_preempts_the_lowest_priority_running_request(kv_manager, victims):
    args = EngineArgs(kv_manager=kv_manager, scheduling_policy="priority", block_size=4,
                      enable_prefix_caching=False)
    kv = create_kv_manager(args.create_cache_config(), 8)              # 32 slots
    sched = Scheduler(args.create_scheduler_config(), kv)
    low_old = _prio_req("low-old", 6, 5, 0.0)    # 12 tokens at most: 2 blocks now, 3 later
    low_new = _prio_req("low-new", 6, 5, 1.0)
    sched.add_request(low_old)
    sched.add_request(low_new)
    out = sched.schedule()
    sched.update(out, {s.request_id: 3 for s in out.scheduled})
    assert {r.request_id for r in sched.running} == {"low-old", "low-new"}
    high = _prio_req("high", 18, 0, 2.0, max_tokens=2)  # 5 blocks: does not fit beside both
    sched.add_request(high)
    out = sched.schedule()
    assert out.preempted == victims              # lowest priority, latest arrival first
    assert out.scheduled[0].request_id == "high"
    assert {s.request_id for s in out.scheduled} == {"high", "low-old"} - set(victims)
    assert low_new.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == sorted(victims, key=lambda v: v != "low-old")
    sched.update(out, {s.request_id: 3 for s in out.scheduled})
    # the preempted requests do not bounce back while "high" runs
    out = sched.schedule()
    assert out.preempted == []
    assert not set(victims) & {s.request_id for s in out.scheduled}


def test_priority_never_preempts_equal_priority():
    args = EngineArgs(scheduling_policy="priority", block_size=4, enable_prefix_caching=False)
    sched = Scheduler(args.create_scheduler_config(), create_kv_manager(args.create_cache_config(), 4))
    sched.add_request(_prio_req("a", 10, 1, 0.0))
    out = sched.schedule()
    sched.update(out, {"a": 3})
    sched.add_request(_prio_req("b", 10, 1, 1.0))
    out = sched.schedule()
    assert out.preempted == [] and [s.request_id for s in out.scheduled] == ["a"]


def test_priority_respects_max_num_seqs():
    args = EngineArgs(scheduling_policy="priority", max_num_seqs=1, enable_prefix_caching=False)
    sched = Scheduler(args.create_scheduler_config(), create_kv_manager(args.create_cache_config(), 64))
    sched.add_request(_prio_req("low", 5, 9, 0.0))
    out = sched.schedule()
    sched.update(out, {"low": 3})
    sched.add_request(_prio_req("high", 5, 0, 1.0))
    out = sched.schedule()
    assert out.preempted == ["low"] and [s.request_id for s in out.scheduled] == ["high"]


@pytest.mark.parametrize("kv_manager", ["paged", "buddy", "contiguous"])
def test_priority_runs_keep_kv_contents_right(kv_manager):
    rng = random.Random(3)
    first = [_prio_req(str(i), rng.randint(1, 40), 5, i * 1e-3, rng.randint(1, 20))
             for i in range(8)]
    later = {6: [_prio_req(f"h{i}", rng.randint(1, 40), rng.randint(0, 4), 1.0 + i,
                           rng.randint(1, 20)) for i in range(6)]}
    args = EngineArgs(kv_manager=kv_manager, scheduling_policy="priority", block_size=4,
                      max_num_batched_tokens=32, enable_prefix_caching=False)
    res = simulate(args, 32, first, arrivals=later)
    assert res.preemptions > 0


# -- settings ----------------------------------------------------------------------------------


def test_engine_args_validation():
    EngineArgs(batching="length-bucket", max_batch_size=8, bucket_window_s=0.0,
               memory_pool_ratio=1.0)
    for bad in (dict(max_batch_size=0), dict(bucket_window_s=-0.1), dict(memory_pool_ratio=0.0),
                dict(memory_pool_ratio=1.01), dict(scheduling_policy="priority",
                                                   batching="static")):
        with pytest.raises(ValueError):
            EngineArgs(**bad)

"""Background requests (batch lines): below every foreground request, under either policy."""
from __future__ import annotations

import dataclasses

import pytest

from kvserve.engine.engine_args import EngineArgs
from kvserve.core.kv import create_kv_manager
from kvserve.core.scheduler import Scheduler
from tests.core.kv_sim import make_request


def _scheduler(num_blocks=512, **kw) -> Scheduler:
    args = EngineArgs(enable_prefix_caching=False, block_size=16, **kw)
    return Scheduler(args.create_scheduler_config(),
                     create_kv_manager(args.create_cache_config(), num_blocks))


def _bg(rid, prompt, max_tokens, arrival=0.0):
    return dataclasses.replace(make_request(rid, prompt, max_tokens, arrival), background=True)


def _advance(sched, out):
    sched.update(out, {s.request_id: 7 for s in out.scheduled if s.sampling is not None})


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_foreground_waits_behind_no_background_request(policy):
    sched = _scheduler(scheduling_policy=policy)
    sched.add_request(_bg("b1", range(10), 8, arrival=0.0))
    sched.add_request(_bg("b2", range(10), 8, arrival=1.0))
    sched.add_request(make_request("f", range(10), 8, arrival=2.0))
    assert [r.request_id for r in sched.waiting] == ["f", "b1", "b2"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_waiting_foreground_request_preempts_a_background_one(policy):
    sched = _scheduler(scheduling_policy=policy, max_num_seqs=2)
    sched.add_request(_bg("b1", range(10), 50))
    sched.add_request(_bg("b2", range(100, 110), 50, arrival=1.0))
    _advance(sched, sched.schedule())
    sched.add_request(make_request("f", range(200, 210), 5, arrival=2.0))
    out = sched.schedule()
    assert out.preempted == ["b2"]  # the latest background arrival
    assert [s.request_id for s in out.scheduled][0] == "f"
    assert [r.request_id for r in sched.waiting] == ["b2"]


def test_background_prompts_are_capped_while_foreground_runs():
    sched = _scheduler(background_step_tokens=16)
    sched.add_request(make_request("f", range(10), 50))
    _advance(sched, sched.schedule())
    sched.add_request(_bg("b", range(100, 400), 5, arrival=1.0))
    tokens = []
    for _ in range(3):
        out = sched.schedule()
        tokens.append({s.request_id: len(s.token_ids) for s in out.scheduled})
        _advance(sched, out)
    assert tokens == [{"f": 1, "b": 16}] * 3  # the decode's step stays short


def test_alone_a_background_request_runs_at_full_speed():
    sched = _scheduler(background_step_tokens=16)
    sched.add_request(_bg("b", range(300), 5))
    out = sched.schedule()
    assert [len(s.token_ids) for s in out.scheduled] == [300]


def test_background_requests_are_the_first_victims():
    sched = _scheduler(num_blocks=6, max_num_seqs=4)  # 96 token slots
    sched.add_request(make_request("f1", range(30), 40))
    sched.add_request(_bg("b", range(100, 130), 40, arrival=1.0))
    sched.add_request(make_request("f2", range(200, 230), 40, arrival=2.0))
    preempted = []
    for _ in range(20):
        out = sched.schedule()
        preempted += out.preempted
        _advance(sched, out)
    assert preempted[0] == "b"  # f2 is preempted only once no background request runs


def test_zero_background_tokens_means_they_wait():
    sched = _scheduler(background_step_tokens=0)
    sched.add_request(make_request("f", range(10), 3))
    sched.add_request(_bg("b", range(100, 110), 3, arrival=1.0))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["f"]


def test_the_cap_lingers_after_the_last_foreground_request(monkeypatch):
    import kvserve.core.scheduler as scheduler_module
    sched = _scheduler(background_step_tokens=8)
    sched.add_request(make_request("f", range(10), 1))
    _advance(sched, sched.schedule())  # f's prompt and only token: finished
    sched.add_request(_bg("b", range(100, 400), 5, arrival=1.0))
    out = sched.schedule()
    assert [len(s.token_ids) for s in out.scheduled] == [8]
    _advance(sched, out)
    monkeypatch.setattr(scheduler_module, "FOREGROUND_LINGER_S", 0.0)
    assert [len(s.token_ids) for s in sched.schedule().scheduled] == [292]

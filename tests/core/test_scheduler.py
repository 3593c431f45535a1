"""Scheduler step composition: prompts joining a step under the prefill join limit, and
the drafts decodes carry."""
from __future__ import annotations

import pytest

from kvserve.engine.engine_args import EngineArgs
from kvserve.core.kv import create_kv_manager
from kvserve.core.scheduler import Scheduler
from tests.core.kv_sim import make_request


def _scheduler(**kw) -> Scheduler:
    args = EngineArgs(enable_prefix_caching=False, **kw)
    return Scheduler(args.create_scheduler_config(), create_kv_manager(args.create_cache_config(), 512))


def _new_prompts(out) -> list[str]:
    return [s.request_id for s in out.scheduled if s.start_pos == 0]


def test_a_later_prompt_waits_a_step_instead_of_delaying_the_first():
    sched = _scheduler(prefill_join_tokens=256)
    sched.add_request(make_request("a", list(range(420)), 4))
    sched.add_request(make_request("b", list(range(1000, 1209)), 4))
    out = sched.schedule()
    assert _new_prompts(out) == ["a"] and out.num_tokens == 420  # a's first token: 1 step
    sched.update(out, {"a": 7})
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 209)]


def test_short_prompts_share_a_step_until_the_limit_and_decodes_do_not_count():
    sched = _scheduler(prefill_join_tokens=256)
    for i in range(6):
        sched.add_request(make_request(str(i), list(range(i * 1000, i * 1000 + 100)), 50))
    out = sched.schedule()
    assert _new_prompts(out) == ["0", "1", "2"]  # 100, 200 < 256: one more joins
    sched.update(out, {s.request_id: 7 for s in out.scheduled})
    out = sched.schedule()
    assert _new_prompts(out) == ["3", "4", "5"]  # three decodes ride along, not counted


@pytest.mark.parametrize("limit", [None, 0, 10_000])
def test_no_limit_merges_up_to_the_token_budget(limit):
    sched = _scheduler() if limit is None else _scheduler(prefill_join_tokens=limit)
    sched.add_request(make_request("a", list(range(420)), 4))
    sched.add_request(make_request("b", list(range(1000, 1209)), 4))
    assert _new_prompts(sched.schedule()) == ["a", "b"]


def test_bad_limit_is_refused():
    with pytest.raises(ValueError, match="prefill_join_tokens must be an integer >= 0"):
        EngineArgs(prefill_join_tokens=-1)


def _drafted(out) -> dict[str, list[int]]:
    return {s.request_id: s.token_ids[len(s.token_ids) - s.num_draft_tokens:]
            for s in out.scheduled if s.num_draft_tokens}


def test_decodes_carry_the_drafts_set_for_them_as_max_tokens_leaves_room():
    sched = _scheduler()
    sched.add_request(make_request("a", list(range(10)), 8))
    sched.add_request(make_request("b", list(range(100, 110)), 3))
    sched.set_drafts({"a": [1, 2]})  # a prompt step: no drafts
    out = sched.schedule()
    assert _drafted(out) == {}
    sched.update(out, {"a": 7, "b": 7})
    sched.set_drafts({"a": [1, 2, 3], "b": [4, 5, 6]})
    out = sched.schedule()
    assert _drafted(out) == {"a": [1, 2, 3], "b": [4]}  # b may yield two tokens more
    sched.update(out, {"a": [8], "b": [9]})
    out = sched.schedule()  # drafts are taken once
    assert _drafted(out) == {}
    sched.update(out, {"a": [8], "b": [9]})
    sched.set_drafts({"a": [1]})
    sched.set_drafts({})  # in place of the drafts set before
    assert _drafted(sched.schedule()) == {}


def test_requests_for_more_adapters_than_slots_wait_and_others_pass_them():
    """max_loras adapters run at once; a request for another waits while the base and
    the running adapters' requests behind it are admitted; it runs once a slot frees."""
    from kvserve.lora.request import LoRARequest
    loras = [LoRARequest(f"a{i}", i + 1, f"/adapters/a{i}") for i in range(3)]
    args = EngineArgs(enable_prefix_caching=False)
    sched = Scheduler(args.create_scheduler_config(),
                      create_kv_manager(args.create_cache_config(), 512), max_loras=2)
    for rid, lora in (("a0", loras[0]), ("a1", loras[1]), ("a2", loras[2]), ("base", None),
                      ("a0-again", loras[0])):
        req = make_request(rid, list(range(10)), 2)
        req.lora_request = lora
        sched.add_request(req)
    out = sched.schedule()
    assert _new_prompts(out) == ["a0", "a1", "base", "a0-again"]
    assert [s.lora for s in out.scheduled] == [loras[0], loras[1], None, loras[0]]
    assert out.stats.running_loras == ("a0", "a1") and out.stats.waiting_loras == ("a2",)
    sched.update(out, {s.request_id: 7 for s in out.scheduled})
    out = sched.schedule()
    sched.update(out, {s.request_id: 7 for s in out.scheduled})  # max_tokens 2: all done
    assert _new_prompts(sched.schedule()) == ["a2"]

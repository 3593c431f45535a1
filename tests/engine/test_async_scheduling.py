"""Async scheduling: the next step computes while this one's outputs are made, and
nothing a request sees changes — tokens, stops, seeds, penalties, grammars, aborts."""
from __future__ import annotations

import json
import threading

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.engine_args import EngineArgs
from kvserve.structured_output import StructuredOutputsParams
from tests.helpers import prompts_of_lengths

PROMPTS = prompts_of_lengths([3, 9, 17, 30, 5, 12])


@pytest.fixture(scope="module")
def pair(llama_dir):
    """(a synchronous LLM, an async-scheduling one) with the same settings."""
    return (LLM(llama_dir, max_num_seqs=4, block_size=4),
            LLM(llama_dir, max_num_seqs=4, block_size=4, async_scheduling=True))


def _both(pair, prompts, params):
    outs = []
    for llm in pair:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.kv.stats().num_used_blocks == 0, "blocks leaked"
        assert not llm.engine.has_unfinished_requests()
        outs.append([[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
                     for o in got])
    return outs


def test_the_next_step_is_computing_when_a_step_returns(pair):
    engine = pair[1].engine
    threads = set()
    execute = engine.worker.runner.execute

    def recorded(out):
        threads.add(threading.current_thread().name)
        return execute(out)

    engine.worker.runner.execute = recorded
    try:
        engine.add_request("r", {"prompt_token_ids": PROMPTS[0]},
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        in_flight = []
        while engine.has_unfinished_requests():
            engine.step()
            in_flight.append(engine._in_flight is not None)
    finally:
        del engine.worker.runner.execute
    assert threads == {"kvserve-compute"}, threads
    # prefill + 6 decodes, each started before the outputs of the one before were made
    assert in_flight == [True] * 5 + [False], in_flight


def test_greedy_seeded_and_penalised_tokens_are_unchanged(pair):
    for params in [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                   SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16, n=2),
                   SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5,
                                  presence_penalty=0.5, frequency_penalty=0.5)]:
        sync, overlapped = _both(pair, [{"prompt_token_ids": p} for p in PROMPTS], params)
        assert overlapped == sync, params


def test_stop_strings_tokens_and_lengths_end_requests_alike(pair):
    free = pair[0].generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
    # a stop string from the middle of each greedy text, and a stop token from another's
    texts = [o.outputs[0].text for o in free]
    stops = sorted({t[len(t) // 2:len(t) // 2 + 2] for t in texts if len(t) > 4})
    stop_ids = [free[1].outputs[0].token_ids[5]]
    params = SamplingParams(temperature=0, max_tokens=24, stop=stops, stop_token_ids=stop_ids,
                            min_tokens=2)
    sync, overlapped = _both(pair, [{"prompt_token_ids": p} for p in PROMPTS], params)
    assert overlapped == sync
    reasons = [c[3] for out in sync for c in out]
    assert any(isinstance(r, str) for r in reasons), ("no stop string ended a request", reasons)
    assert stop_ids[0] in reasons, ("no stop token ended a request", reasons)


def test_constrained_requests_keep_their_output():
    """On the shipped model, whose JSON ends: each grammar advances by one step's token
    before the next step's mask is made."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # what the model would add is not the test's
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=schema))
    prompts = ["x = ", "def f(): return ", "y = "]
    sync, overlapped = _both((LLM(max_num_seqs=4), LLM(max_num_seqs=4, async_scheduling=True)),
                             prompts, params)
    assert overlapped == sync
    for out in overlapped:
        assert set(json.loads(out[0][1])) == {"a"}


def test_aborts_while_a_step_computes_free_everything(pair):
    engine = pair[1].engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in PROMPTS[:4]]
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request(ids[:2])
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in ids[:2]
            if out.finished:
                finished.add(out.request_id)
    assert finished == set(ids[2:])
    assert engine.kv.stats().num_used_blocks == 0


def test_preemption_under_overlap_keeps_tokens(llama_dir, pair):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    small = LLM(llama_dir, max_num_seqs=4, block_size=4, num_kv_blocks=16,
                async_scheduling=True)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in pair[0].generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert small.engine.scheduler.num_preemptions > 0, "no preemption: test lost its point"
    assert small.engine.kv.stats().num_used_blocks == 0


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(pair, monkeypatch):
    engine = pair[1].engine
    runner = engine.worker.runner
    execute, calls = runner.execute, []

    def flaky(out):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return execute(out)

    monkeypatch.setattr(runner, "execute", flaky)
    rid = engine.add_request(None, {"prompt_token_ids": PROMPTS[1]},
                             SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.error for o in outs if o.request_id == rid][-1] is not None
    assert engine.kv.stats().num_used_blocks == 0
    monkeypatch.setattr(runner, "execute", execute)
    ok = pair[1].generate("again", SamplingParams(max_tokens=3), use_tqdm=False)
    assert ok[0].outputs[0].finish_reason in ("length", "stop")


def test_async_scheduling_refuses_speculative_decoding(llama_dir):
    args = EngineArgs(model=llama_dir, async_scheduling=True,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="async_scheduling.*speculative decoding"):
        args.create_engine_config()


def test_an_id_still_in_the_running_step_is_refused_and_close_waits_for_it(llama_dir):
    llm = LLM(llama_dir, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, params)
    engine.step()
    engine.abort_request("a")
    assert engine.has_unfinished_requests()  # the step computing "a" still runs
    assert not engine.reset_prefix_cache()
    with pytest.raises(ValueError, match="still in the running step"):
        engine.add_request("a", {"prompt_token_ids": PROMPTS[1]}, params)
    assert engine.step() == []  # the aborted request's token is dropped
    engine.add_request("a", {"prompt_token_ids": PROMPTS[1]}, params)
    engine.step()
    assert engine._in_flight is not None
    engine.close()  # waits for the running step
    assert engine._in_flight is None

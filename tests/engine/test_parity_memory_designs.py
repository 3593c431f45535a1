"""Every kv_manager x batching combination gives transformers' greedy tokens exactly,
including runs that preempt, and buddy runs that move requests to larger runs."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.helpers import hf_greedy, prompts_of_lengths

LENGTHS = [1, 3, 7, 16, 17, 31, 64, 100, 5, 47]
MAX_NEW = 12
KV_MANAGERS = ["paged", "buddy", "contiguous"]
BATCHINGS = ["continuous", "length-bucket", "static"]


SETTINGS = {
    # small blocks and chunked prefill: buddy runs grow (and move) mid-prompt
    "chunked": dict(block_size=4, max_num_batched_tokens=16),
    # a KV budget far below the workload's: paged and buddy preempt, buddy moves
    "tight": dict(num_kv_blocks=24, block_size=8),
}


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_lengths(LENGTHS)


@pytest.fixture(scope="module")
def oracle(llama_dir, prompts):
    return hf_greedy(llama_dir, prompts, MAX_NEW)


def _generate(model_dir, prompts, **engine_args):
    """Greedy tokens of every prompt, the engine, and the most requests that ran in one
    step (from each step's scheduler stats)."""
    engine = LLM(model_dir, max_batch_size=4, bucket_window_s=0.0, **engine_args).engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    got, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        if engine.last_step_stats is not None:
            peak = max(peak, engine.last_step_stats.num_running)
    assert engine.kv.stats().num_used_blocks == 0, "blocks leaked after the run"
    return [got[str(i)] for i in range(len(prompts))], engine, peak


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize("kv_manager", KV_MANAGERS)
def test_greedy_parity(kv_manager, batching, setting, llama_dir, prompts, oracle):
    got, engine, peak = _generate(llama_dir, prompts, kv_manager=kv_manager,
                                  batching=batching, **SETTINGS[setting])
    assert got == oracle
    stats = engine.kv.stats()
    assert peak >= 1
    if batching == "static":
        assert peak <= 4
    if kv_manager == "buddy":
        assert stats.moved_blocks > 0, "no buddy run moved: the test lost its point"
    if setting == "tight" and kv_manager != "contiguous" and batching != "static":
        assert engine.scheduler.num_preemptions > 0, "no preemption: the test lost its point"


@pytest.mark.parametrize("kv_manager", KV_MANAGERS)
def test_greedy_parity_with_priority_preemption(kv_manager, llama_dir, prompts, oracle):
    """Low-priority requests run; higher-priority ones arrive and preempt them."""
    llm = LLM(llama_dir, kv_manager=kv_manager, scheduling_policy="priority",
              num_kv_blocks=24, block_size=8, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # every third step, a request that outranks the last
            i, prompt = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params,
                               priority=len(prompts) - i)
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [got[str(i)] for i in range(len(prompts))] == oracle
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.stats().num_used_blocks == 0

"""No KV block is ever lost: after generate, abort and preemption everything is free."""
from __future__ import annotations

from kvserve import LLM, SamplingParams
from tests.helpers import prompts_of_lengths


def test_blocks_free_after_abort_mid_generation(llama_dir):
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=40)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params)
           for p in prompts_of_lengths([10, 20, 30, 5])]
    for _ in range(5):
        engine.step()
    assert engine.kv.stats().num_used_blocks > 0
    engine.abort_request(ids[:2])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.stats().num_used_blocks == 0
    engine.abort_request(ids[2:])  # aborting finished requests is harmless
    assert engine.kv.stats().num_used_blocks == 0


def test_blocks_free_after_abort_while_waiting(llama_dir):
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=40, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=5)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params)
           for p in prompts_of_lengths([4, 4, 4])]
    engine.step()
    engine.abort_request(ids)
    assert not engine.has_unfinished_requests()
    assert engine.kv.stats().num_used_blocks == 0


def test_usage_reported_during_run(llama_dir):
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=30)
    engine = llm.engine
    engine.add_request(None, {"prompt_token_ids": list(range(5, 25))},
                       SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    stats = engine.kv.stats()
    assert stats.num_used_blocks == 5  # the 20 prompt tokens, in blocks of 4
    assert stats.used_tokens == 20 and stats.usage == 5 / 30
    engine.step()  # the first sampled token needs a sixth block
    assert engine.kv.stats().num_used_blocks == 6

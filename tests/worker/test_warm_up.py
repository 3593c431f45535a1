"""The runner's warm-up step at engine start leaves no trace the engine can see."""
from __future__ import annotations

from kvserve import LLM, SamplingParams
from tests.helpers import hf_greedy, prompts_of_lengths


def test_warm_up_sizes_itself_to_the_pool(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64, block_size=8)
    runner = llm.engine.worker.runner
    assert runner.warm_up(100, max_prompt_len=40) == 80  # two prompts of 40, 6 blocks each
    assert runner.warm_up(2048) == 511  # the pool's 512 slots: one prompt and its decode
    assert LLM(llama_dir, num_kv_blocks=1, block_size=4).engine.worker.runner.warm_up(64) == 3
    assert LLM(llama_dir, num_kv_blocks=1, block_size=1).engine.worker.runner.warm_up(64) == 0


def test_engine_starts_warm_with_every_block_free_and_exact(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=40, block_size=4)  # warm-up wrote into these blocks
    assert llm.engine.kv.stats().num_used_blocks == 0
    prompts = prompts_of_lengths([3, 30, 60])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 8)

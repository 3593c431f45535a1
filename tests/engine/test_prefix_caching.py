"""Prefix caching gives the same tokens as transformers, with the cache on or off."""
from __future__ import annotations

from kvserve import LLM, SamplingParams
from tests.helpers import hf_greedy, prompts_of_lengths

MAX_NEW = 10


def _shared_prompts():
    system = prompts_of_lengths([37], seed=3)[0]
    tails = prompts_of_lengths([1, 5, 9, 20, 3], seed=4)
    return [system + t for t in tails] + [system[:20], system]


def _run(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def test_cache_on_off_and_transformers_agree(llama_dir):
    prompts = _shared_prompts()
    ref = hf_greedy(llama_dir, prompts, MAX_NEW)
    on = LLM(llama_dir, block_size=4, enable_prefix_caching=True)
    off = LLM(llama_dir, block_size=4, enable_prefix_caching=False)
    first, _ = _run(on, prompts)
    second, outs = _run(on, prompts)  # everything cached now
    assert first == ref and second == ref
    assert _run(off, prompts)[0] == ref
    assert all(o.num_cached_tokens > 0 for o in outs)
    stats = on.engine.kv.stats()
    assert stats.prefix_hits > 0 and stats.num_used_blocks == 0
    assert on.reset_prefix_cache()  # forgotten: the prompts are computed in full again
    third, outs = _run(on, prompts)
    assert third == ref and all(o.num_cached_tokens == 0 for o in outs[:1])


def test_reset_prefix_cache_refused_while_requests_run(llama_dir):
    llm = LLM(llama_dir, block_size=4)
    llm.engine.add_request("a", {"prompt_token_ids": _shared_prompts()[0]},
                           SamplingParams(max_tokens=3))
    assert not llm.reset_prefix_cache()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache()


def test_same_step_sharing_and_chunking(llama_dir):
    prompts = _shared_prompts()
    llm = LLM(llama_dir, block_size=4, max_num_batched_tokens=16)
    assert _run(llm, prompts)[0] == hf_greedy(llama_dir, prompts, MAX_NEW)


def test_cache_with_preemption(llama_dir):
    prompts = _shared_prompts()
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=20)
    got, _ = _run(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == hf_greedy(llama_dir, prompts, MAX_NEW)
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_n_samples_share_the_prompt(llama_dir):
    llm = LLM(llama_dir, block_size=4)
    prompt = prompts_of_lengths([30], seed=9)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        n=4, temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)[0]
    ref = hf_greedy(llama_dir, [prompt], MAX_NEW)[0]
    assert all(o.token_ids == ref for o in out.outputs)
    stats = llm.engine.kv.stats()
    assert stats.prefix_hits >= 3 * 28  # children 1..3 reuse the 7 full prompt blocks


def test_n_samples_copy_the_part_filled_prompt_block(llama_dir):
    # the budget fits one prompt: child 0 prefills alone, its siblings come a step later,
    # take the 3 full blocks from the cache and a copy of the part-filled 4th block
    llm = LLM(llama_dir, block_size=8, max_num_batched_tokens=31)
    prompt = prompts_of_lengths([31], seed=11)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        n=4, temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)[0]
    ref = hf_greedy(llama_dir, [prompt], MAX_NEW)[0]
    assert all(o.token_ids == ref for o in out.outputs)
    assert llm.engine.kv.tail_copies == 3
    assert llm.engine.kv.stats().num_used_blocks == 0

"""Sampling through the whole engine: seeds, stops, min_tokens, logprobs, n."""
from __future__ import annotations

import math

import pytest

from kvserve import LLM, SamplingParams
from tests.helpers import hf_logprobs, prompts_of_lengths


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, block_size=4)


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_seeded_sampling_independent_of_batch(llm):
    target = prompts_of_lengths([9])[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                            ignore_eos=True)
    alone = llm.generate(_ids([target]), params, use_tqdm=False)[0].outputs[0].token_ids
    others = prompts_of_lengths([3, 30, 12, 50], seed=7)
    noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(_ids(others[:2] + [target] + others[2:]),
                         [noisy, noisy, params, noisy, noisy], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    again = llm.generate(_ids([target]), params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_different_seeds_differ(llm):
    prompt = _ids(prompts_of_lengths([9]))
    outs = [llm.generate(prompt, SamplingParams(temperature=1.5, seed=s, max_tokens=16,
                                                ignore_eos=True), use_tqdm=False)
            [0].outputs[0].token_ids for s in (1, 2, 3)]
    assert len({tuple(o) for o in outs}) > 1


def test_n_samples_are_distinct_and_counted(llm):
    out = llm.generate(_ids(prompts_of_lengths([6])), SamplingParams(
        n=3, temperature=1.5, seed=5, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_stop_string_cuts_text_across_tokens(llm):
    prompt = _ids(prompts_of_lengths([8]))
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = free.text
    assert len(text) > 12
    stop = text[5:9]  # a stop string that likely spans a token boundary
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.find(stop)]
    assert stop not in out.text
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                               stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:text.find(stop) + len(stop)]


def test_stop_token_ids_and_eos(llm):
    prompt = _ids(prompts_of_lengths([8]))
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    target = free[4]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20,
                                              stop_token_ids=[target]), use_tqdm=False)[0]
    first = free.index(target)
    assert out.outputs[0].token_ids == free[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == target


def test_min_tokens_blocks_early_stop(llm):
    prompt = _ids(prompts_of_lengths([8]))
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stopper = free[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=5,
                                              stop_token_ids=[stopper]), use_tqdm=False)[0]
    toks = out.outputs[0].token_ids
    assert len(toks) >= 5
    assert stopper not in toks[:5]


def test_max_tokens_gives_length(llm):
    out = llm.generate(_ids(prompts_of_lengths([5])), SamplingParams(
        temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_logprobs_match_transformers(llm, llama_dir):
    prompt = prompts_of_lengths([11])[0]
    out = llm.generate(_ids([prompt]), SamplingParams(temperature=0, max_tokens=6, logprobs=5,
                                                      ignore_eos=True), use_tqdm=False)[0]
    comp = out.outputs[0]
    ref = hf_logprobs(llama_dir, prompt, comp.token_ids)
    assert len(comp.logprobs) == 6
    total = 0.0
    for step, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert token in entry and entry[token].rank == 1
        top = sorted(entry.values(), key=lambda lp: lp.rank)[:5]
        ref_top = ref[step].topk(5)
        for lp, ref_val in zip(top, ref_top.values.tolist()):
            assert abs(lp.logprob - ref_val) < 1e-4
        for tid, lp in entry.items():
            assert abs(lp.logprob - float(ref[step, tid])) < 1e-4
        total += entry[token].logprob
    assert math.isclose(comp.cumulative_logprob, total, rel_tol=1e-6)


def test_penalties_change_output_and_stay_in_vocab(llm):
    prompt = _ids(prompts_of_lengths([8]))
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    pen = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                              repetition_penalty=2.0, frequency_penalty=1.5,
                                              presence_penalty=1.0), use_tqdm=False
                       )[0].outputs[0].token_ids
    assert pen != base
    assert len(set(pen)) >= len(set(base))


def test_top_k_one_is_greedy(llm):
    prompt = _ids(prompts_of_lengths([8]))
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    topk1 = llm.generate(prompt, SamplingParams(temperature=1.0, top_k=1, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False
                         )[0].outputs[0].token_ids
    assert topk1 == greedy


def test_logit_bias_forces_and_bans_tokens(llama_dir):
    from kvserve import LLM
    llm = LLM(llama_dir)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6),
                        use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6,
                                                 logit_bias={42: 100.0}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [42] * 6
    banned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6,
                                                 logit_bias={t: -100.0 for t in base}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert not set(banned) & set(base)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, "):
        llm.generate(prompt, SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"logit_bias value must be in \[-100.0, 100.0\]"):
        SamplingParams(logit_bias={3: 150.0})

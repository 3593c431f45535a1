"""Prompt logprobs equal transformers' log-softmax over the prompt, however the prompt
is chunked, cached, preempted or sampled n times."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.helpers import prompts_of_lengths


@torch.inference_mode()
def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model(input_ids=torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 16, "block_size": 4},
                                      {"num_kv_blocks": 12, "block_size": 8},
                                      {"attention_backend": "torch"}],
                         ids=["plain", "chunked", "preempted", "torch"])
def test_prompt_logprobs_match_transformers(settings, llama_dir):
    prompts = prompts_of_lengths([2, 9, 40, 33])
    llm = LLM(llama_dir, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    # twice: the second time the prompts are in the prefix cache, and must still be scored
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            entries = out.prompt_logprobs
            assert len(entries) == len(prompt) and entries[0] is None
            expected = hf_prompt_logprobs(llama_dir, prompt)
            for pos, entry in enumerate(entries[1:], start=1):
                token = prompt[pos]
                assert entry[token].logprob == pytest.approx(
                    float(expected[pos - 1, token]), abs=1e-4)
                assert entry[token].rank == int((expected[pos - 1] > expected[pos - 1, token])
                                                .sum()) + 1
                top = expected[pos - 1].topk(3)
                ranked = sorted((e for t, e in entry.items() if e.rank <= 3),
                                key=lambda e: e.rank)
                assert [e.logprob for e in ranked[:3]] == pytest.approx(top.values.tolist(),
                                                                        abs=1e-4)
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_n_samples_share_one_prompt_scoring_and_absent_when_not_asked(llama_dir):
    llm = LLM(llama_dir)
    prompt = {"prompt_token_ids": prompts_of_lengths([12])[0]}
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=2, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == 12
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # the token's own, no top
    plain = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)

"""The llama.cpp peer's kvserve side: the same timings, the figures, the agreement."""
from __future__ import annotations

import pytest

from kvserve.bench import llamacpp
from kvserve.bench.workloads import BenchRequest


def _request(tokens, steps, total, ttft=0.01):
    return {"ttft_s": ttft, "steps_s": steps, "total_s": total, "tokens": tokens}


def test_summarize_takes_the_median_step_and_end_to_end_rate():
    out = llamacpp.summarize([_request([1, 2, 3], [0.01, 0.03], 0.05),
                              _request([4, 5], [0.02], 0.05)])
    assert out["decode_step_ms"] == pytest.approx(20.0)
    assert out["decode_tok_s"] == pytest.approx(50.0)
    assert out["sequential_output_tok_s"] == pytest.approx(5 / 0.1)
    assert out["requests"] == 2


def test_token_agreement_compares_the_first_tokens_only():
    n = llamacpp.AGREEMENT_TOKENS
    ours = [_request(list(range(n)) + [1], [], 1), _request([7] * n, [], 1)]
    theirs = [_request(list(range(n)) + [2], [], 1), _request([7] * (n - 1) + [8], [], 1)]
    assert llamacpp.token_agreement(ours, theirs) == 0.5


def test_sequential_requests_cap_the_output():
    reqs = [BenchRequest([1, 2], 500), BenchRequest([3], 4), BenchRequest([5], 9)]
    out = llamacpp.sequential_requests(reqs, 2)
    assert [(r.prompt_token_ids, r.max_tokens) for r in out] == \
        [([1, 2], llamacpp.MAX_NEW_TOKENS), ([3], 4)]


def test_kvserve_sequential_times_each_request_alone(llama_dir):
    from kvserve import LLM, SamplingParams
    llm = LLM(llama_dir, num_threads=1)
    reqs = [BenchRequest([5, 6, 7], 6), BenchRequest([8, 9], 4)]
    out = llamacpp.kvserve_sequential(llm, reqs)
    assert [len(r["tokens"]) for r in out] == [6, 4]
    assert [len(r["steps_s"]) for r in out] == [5, 3]  # every token after the first
    assert all(r["ttft_s"] > 0 and r["total_s"] >= r["ttft_s"] for r in out)
    greedy = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)
    assert out[0]["tokens"] == list(greedy[0].outputs[0].token_ids)


def test_the_converter_wrapper_declares_gpt2s_pre_tokenizer():
    assert 'get_vocab_base_pre = lambda self, tokenizer: "gpt-2"' in llamacpp.CONVERT_SOURCE
    compile(llamacpp.CONVERT_SOURCE, "convert.py", "exec")
    compile(llamacpp.RUNNER_SOURCE, "runner.py", "exec")

"""Greedy tokens are identical to transformers', in every configuration of the engine."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import ARCHS
from tests.helpers import greedy_oracle, hf_greedy, prompts_of_lengths

LENGTHS = [1, 3, 7, 16, 17, 31, 64, 100, 5, 47]
MAX_NEW = 12


def _kvserve_greedy(model_dir: str, prompts, **engine_args) -> list[list[int]]:
    llm = LLM(model_dir, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.engine.kv.stats()
    assert stats.num_used_blocks == 0, "blocks leaked after generate"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def oracle(model_dirs):
    return greedy_oracle(model_dirs, LENGTHS, MAX_NEW)


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_default_settings(arch, model_dirs, oracle):
    got = _kvserve_greedy(model_dirs(arch), prompts_of_lengths(LENGTHS))
    assert got == oracle(arch)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
@pytest.mark.parametrize("engine_args", [
    {"block_size": 4},
    {"max_num_batched_tokens": 8, "block_size": 4},  # every prompt of length > 8 is chunked
    {"num_kv_blocks": 14, "block_size": 8},          # forces preemption by recompute
    {"max_num_seqs": 2},
    {"attention_backend": "torch", "block_size": 8},
    {"linear_min_rows": 1},
    {"linear_min_rows": 16, "max_num_seqs": 3},      # every decode GEMM padded
    {"enforce_eager": True, "max_num_seqs": 3},      # few-row steps layer by layer
    {"async_scheduling": True},
    {"async_scheduling": True, "num_kv_blocks": 14, "block_size": 8,
     "max_num_batched_tokens": 8},                   # overlapped, preempted and chunked
], ids=["block4", "chunked", "preempt", "two-seqs", "torch-attention", "no-row-padding",
        "row-padding-16", "eager", "async", "async-preempt-chunked"])
def test_parity_engine_settings(arch, engine_args, model_dirs, oracle):
    llm_args = dict(engine_args)
    got = _kvserve_greedy(model_dirs(arch), prompts_of_lengths(LENGTHS), **llm_args)
    assert got == oracle(arch)


def test_preemption_really_happens(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=14, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts_of_lengths(LENGTHS)], params,
                 use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0


def test_linear_rope_scaling(model_dirs, tmp_path_factory, tokenizer_dir):
    from tests.helpers import build_tiny_model
    d = build_tiny_model("llama-linear", tmp_path_factory.mktemp("lin"), tokenizer_dir)
    prompts = prompts_of_lengths([5, 40, 90])
    assert _kvserve_greedy(d, prompts) == hf_greedy(d, prompts, MAX_NEW)


def test_default_model_parity_and_no_argument_llm():
    from kvserve import default_model_dir
    from kvserve.model.tokenizer import Tokenizer
    tok = Tokenizer(default_model_dir())
    texts = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def push(self,",
             "for i in range(10):\n    print("]
    prompts = [tok.encode(t) for t in texts]
    llm = LLM()  # no model: the embedded one
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(texts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(default_model_dir(), prompts,
                                                               MAX_NEW)


@pytest.mark.parametrize("engine_args", [{}, {"num_kv_blocks": 14, "block_size": 8}],
                         ids=["roomy", "preempting"])
def test_parity_with_background_requests(llama_dir, oracle, engine_args):
    """Batch lines (background requests) beside foreground ones, preempted first under a
    small pool: every request still gets transformers' tokens."""
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine.engine_args import EngineArgs

    engine = LLMEngine(EngineArgs(model=llama_dir, background_step_tokens=3, **engine_args))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, prompt in enumerate(prompts_of_lengths(LENGTHS)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params, background=i % 2 == 0)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[int(out.request_id)] = out.outputs[0].token_ids
    assert [got[i] for i in range(len(LENGTHS))] == oracle("llama")
    assert engine.kv.stats().num_used_blocks == 0

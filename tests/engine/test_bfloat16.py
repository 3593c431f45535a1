"""bfloat16 compute: packed bf16 linear layers, attention math in float32 (native kernel).

bf16 is not token-exact with anything (transformers in bf16 rounds differently from
itself on another kernel), so the oracle is precision: kvserve in bf16 may stray from
transformers' float32 log-probabilities no further than transformers' own bf16 model
does, with a margin, on the same tokens.
"""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.layers import Linear
from kvserve.model.linear_method import packed_bf16_available
from tests.helpers import hf_logprobs, prompts_of_lengths


def _worst_logprob_error(model_dir: str, **engine_kw) -> tuple[float, float]:
    """(kvserve's, transformers bf16's) largest |logprob - transformers float32| over the
    top-5 entries of greedy continuations of three prompts."""
    llm = LLM(model_dir, dtype="bfloat16", **engine_kw)
    ours = theirs = 0.0
    for prompt in prompts_of_lengths([11, 40, 90]):
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
        comp = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        ref32 = hf_logprobs(model_dir, prompt, comp.token_ids)
        ref16 = hf_logprobs(model_dir, prompt, comp.token_ids, dtype=torch.bfloat16)
        for step, entry in enumerate(comp.logprobs):
            ids = torch.tensor(list(entry))
            got = torch.tensor([lp.logprob for lp in entry.values()])
            ours = max(ours, float((got - ref32[step, ids]).abs().max()))
            theirs = max(theirs, float((ref16[step, ids] - ref32[step, ids]).abs().max()))
    return ours, theirs


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_bfloat16_within_bf16_precision_of_transformers(model_dirs, arch, backend):
    ours, theirs = _worst_logprob_error(model_dirs(arch), attention_backend=backend)
    print(f"{arch} {backend}: kvserve bf16 {ours:.3f}, transformers bf16 {theirs:.3f}")
    assert 0 < ours < 2 * theirs + 0.02, (ours, theirs)


def test_bfloat16_runs_native_attention_and_packed_weights(llama_dir):
    runner = LLM(llama_dir, dtype="bfloat16").engine.worker.runner
    assert runner.native_attention is not None
    assert runner.caches[0].k.dtype == torch.bfloat16
    if packed_bf16_available():
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert all(m.method.packed_weight is not None for m in linears)

"""--kv-cache-dtype: a float16 / bfloat16 KV cache under float32 compute gives the greedy
tokens of transformers whose cache stores its keys and values in the same type."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.engine_args import EngineArgs
from tests.helpers import hf_greedy, prompts_of_lengths, round_kv_cache

LENGTHS = [1, 4, 17, 40, 100, 9]
MAX_NEW = 12


def _hf_greedy_with_kv_dtype(model_dir, prompts, dtype, monkeypatch):
    """transformers' greedy tokens with its cache holding keys and values in ``dtype``."""
    with monkeypatch.context() as m:
        round_kv_cache(m, dtype)
        return hf_greedy(model_dir, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def oracle(model_dirs):
    cache = {}

    def get(arch, dtype):
        if (arch, dtype) not in cache:
            with pytest.MonkeyPatch.context() as m:
                cache[arch, dtype] = _hf_greedy_with_kv_dtype(
                    model_dirs(arch), prompts_of_lengths(LENGTHS), dtype, m)
        return cache[arch, dtype]
    return get


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
@pytest.mark.parametrize("engine_args", [{}, {"attention_backend": "torch"},
                                         {"max_num_batched_tokens": 16, "block_size": 4}],
                         ids=["native", "torch", "chunked"])
def test_half_kv_cache_matches_transformers_with_same_cache(arch, kv_cache_dtype, engine_args,
                                                            model_dirs, oracle):
    llm = LLM(model_dirs(arch), kv_cache_dtype=kv_cache_dtype, **engine_args)
    runner = llm.engine.worker.runner
    assert runner.caches[0].k.dtype == getattr(torch, kv_cache_dtype)
    assert (runner.native_attention is None) == (engine_args.get("attention_backend") == "torch")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts_of_lengths(LENGTHS)], params,
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == oracle(arch, getattr(torch, kv_cache_dtype))
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_bfloat16_reference_differs_from_float32(model_dirs, monkeypatch):
    """The oracle above is not the float32 model in disguise: a bfloat16 cache changes
    some tokens of these models."""
    d, prompts = model_dirs("llama"), prompts_of_lengths(LENGTHS)
    assert _hf_greedy_with_kv_dtype(d, prompts, torch.bfloat16, monkeypatch) != \
        hf_greedy(d, prompts, MAX_NEW)


def test_half_kv_cache_holds_twice_the_blocks(llama_dir):
    full = LLM(llama_dir, kv_cache_memory="1MiB")
    half = LLM(llama_dir, kv_cache_memory="1MiB", kv_cache_dtype="float16")
    assert half.engine.kv_layout.num_blocks == 2 * full.engine.kv_layout.num_blocks


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'float32', "
                                         r"'float16', 'bfloat16'\], got 'fp8'"):
        EngineArgs(kv_cache_dtype="fp8")

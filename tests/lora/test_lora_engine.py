"""LoRA adapters against peft in transformers: greedy tokens identical per adapter with
four adapters and the base mixed in one batch, with fewer slots than adapters, under
preemption, with speculative decoding, on torch's path, for fused checkpoints; KV shared
through the prefix cache only within one adapter."""
from __future__ import annotations

import pytest

from kvserve import LLM, LoRARequest, SamplingParams
from tests.helpers import prompts_of_lengths
from tests.lora.adapters import LENGTHS, MAX_TOKENS

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def requests_of(adapters: list[str]) -> list[LoRARequest | None]:
    return [None] + [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]


def run_mixed(llm: LLM, adapters: list[str], choice: list[int]) -> list[list[int]]:
    loras = requests_of(adapters)
    outs = llm.generate(prompts_of_lengths(LENGTHS), GREEDY,
                        lora_request=[loras[c] for c in choice], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def expected(tokens: list[list[list[int]]], choice: list[int]) -> list[list[int]]:
    return [tokens[c][p] for p, c in enumerate(choice)]


MIXED = [i % 5 for i in range(len(LENGTHS))]  # the base and each adapter, twice each


def test_the_adapters_change_the_tokens(peft_tokens):
    tokens = peft_tokens("llama")
    assert all(tokens[i] != tokens[0] for i in range(1, 5))  # else the test proves nothing


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_four_adapters_and_the_base_in_one_batch_match_peft(model_dirs, lora_adapters,
                                                            peft_tokens, backend):
    llm = LLM(model_dirs("llama"), enable_lora=True, max_loras=4, max_lora_rank=16,
              num_kv_blocks=200, attention_backend=backend)
    assert run_mixed(llm, lora_adapters("llama"), MIXED) == expected(peft_tokens("llama"), MIXED)


def test_fewer_slots_than_adapters_take_turns(model_dirs, lora_adapters, peft_tokens):
    llm = LLM(model_dirs("llama"), enable_lora=True, max_loras=2, max_cpu_loras=2,
              max_lora_rank=16, num_kv_blocks=200)
    worker = llm.engine.worker.lora
    for run in range(2):
        assert run_mixed(llm, lora_adapters("llama"), MIXED) == \
            expected(peft_tokens("llama"), MIXED)
        if run == 0:
            assert worker.loads == 4  # two slots held four adapters in turn
    assert worker.loads > 4  # the cache of two had dropped the first adapters: read again


def test_preempted_adapter_requests_resume_exactly(model_dirs, lora_adapters, peft_tokens):
    llm = LLM(model_dirs("llama"), enable_lora=True, max_loras=4, max_lora_rank=16,
              num_kv_blocks=9, block_size=8)
    assert run_mixed(llm, lora_adapters("llama"), MIXED) == expected(peft_tokens("llama"), MIXED)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
])
def test_speculative_decoding_keeps_each_adapters_tokens(model_dirs, lora_adapters,
                                                         peft_tokens, spec, monkeypatch):
    from tests.helpers import flat_step_cost
    flat_step_cost(monkeypatch)  # drafts always pay: they are verified in every step
    llm = LLM(model_dirs("llama"), enable_lora=True, max_loras=4, max_lora_rank=16,
              num_kv_blocks=200, speculative_config=spec)
    assert run_mixed(llm, lora_adapters("llama"), MIXED) == expected(peft_tokens("llama"), MIXED)
    assert llm.engine.speculator.stats.num_draft_tokens > 0


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_other_architectures_match_peft(arch, model_dirs, lora_adapters, peft_tokens):
    """qwen3: q/k norms between the projections; phi3: q/k/v and gate/up fused in the
    checkpoint itself (its adapters target the fused modules)."""
    llm = LLM(model_dirs(arch), enable_lora=True, max_loras=4, max_lora_rank=16,
              num_kv_blocks=200)
    assert run_mixed(llm, lora_adapters(arch), MIXED) == expected(peft_tokens(arch), MIXED)


def test_the_prefix_cache_shares_kv_within_an_adapter_only(model_dirs, lora_adapters,
                                                           peft_tokens):
    llm = LLM(model_dirs("llama"), enable_lora=True, max_loras=4, max_lora_rank=16,
              num_kv_blocks=200, block_size=8, enable_prefix_caching=True)
    loras = requests_of(lora_adapters("llama"))
    prompt = prompts_of_lengths(LENGTHS)[5]  # 40 tokens: four full blocks
    kv = llm.engine.kv
    hits = []
    for c in (1, 1, 2, 0, 2):
        before = kv.cache.hits
        out = llm.generate([prompt], GREEDY, lora_request=loras[c], use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == peft_tokens("llama")[c][5]
        hits.append(kv.cache.hits - before)
    # a0 again: its blocks; a1 and the base: none of a0's; a1 again: its own
    assert hits[0] == 0 and hits[1] > 0 and hits[2] == 0 and hits[3] == 0 and hits[4] > 0

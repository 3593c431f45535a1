"""Swap space, the disk tier and KV warm-up keep tokens exact and leak nothing."""
from __future__ import annotations

import json

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.kv.tiers import OFFLOAD, ONLOAD, SWAP_IN, SWAP_OUT
from tests.helpers import hf_greedy, prompts_of_lengths

MAX_NEW = 10
LENGTHS = [30, 7, 45, 16, 22, 3, 38]


def _run(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(llama_dir):
    return hf_greedy(llama_dir, prompts_of_lengths(LENGTHS), MAX_NEW)


def test_swap_round_trip_is_exact(llama_dir, reference):
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=24, preemption_mode="swap",
              swap_space=0.001, enable_prefix_caching=False)
    assert _run(llm, prompts_of_lengths(LENGTHS)) == reference
    kv = llm.engine.kv
    assert llm.engine.scheduler.num_preemptions > 0
    assert kv.moved[SWAP_OUT] > 0 and kv.moved[SWAP_IN] == kv.moved[SWAP_OUT]
    mover = llm.engine.worker.runner.mover
    assert mover.bytes_moved[SWAP_OUT] == mover.bytes_moved[SWAP_IN] > 0
    assert kv.stats().num_used_blocks == 0
    llm.engine.step()  # a last step lets the swap slots read by the final swap-in go free
    assert kv.swap.num_free == kv.swap.num_slots


def test_swap_falls_back_to_recompute_when_full(llama_dir, reference):
    tiny_swap = 2 * 2 * 2 * 4 * 2 * 16 * 4  # bytes of 2 blocks: layers*K/V*bs*heads*dim*4
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=24, preemption_mode="swap",
              swap_space=tiny_swap / 2**30)
    assert _run(llm, prompts_of_lengths(LENGTHS)) == reference
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_disk_tier_round_trip_is_exact(llama_dir, tmp_path):
    shared = prompts_of_lengths([40], seed=11)[0]
    first = [shared + [7, 8]]
    filler = prompts_of_lengths([60, 60], seed=12)
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=32, kv_offload_dir=str(tmp_path),
              kv_offload_size=1 << 20)
    ref_first = hf_greedy(llama_dir, first, MAX_NEW)
    assert _run(llm, first) == ref_first
    _run(llm, filler)  # evicts the shared prefix from memory to disk
    kv = llm.engine.kv
    assert kv.moved[OFFLOAD] > 0
    again = [shared + [9]]
    assert _run(llm, again) == hf_greedy(llama_dir, again, MAX_NEW)
    assert kv.moved[ONLOAD] >= 9  # the 40-token prefix (10 blocks) came back from disk
    assert llm.engine.worker.runner.mover.bytes_moved[ONLOAD] > 0
    assert kv.stats().num_used_blocks == 0
    assert any(tmp_path.iterdir())
    llm.engine.worker.runner.close()
    assert not any(tmp_path.iterdir())


def test_warmup_pins_prompts(llama_dir, tmp_path):
    system = prompts_of_lengths([33], seed=21)[0]
    path = tmp_path / "warm.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": system}) + "\n")
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=40, warmup_prompts=str(path))
    kv = llm.engine.kv
    assert kv.stats().num_used_blocks == 8  # 33 tokens: 8 full blocks pinned
    _run(llm, prompts_of_lengths([60, 60, 60], seed=22))  # pressure cannot evict them
    hits_before = kv.stats().prefix_hits
    prompt = [system + [5, 6]]
    assert _run(llm, prompt) == hf_greedy(llama_dir, prompt, MAX_NEW)
    assert kv.stats().prefix_hits - hits_before == 32


def test_tiers_need_paged(llama_dir):
    with pytest.raises(ValueError, match="kv_manager 'paged'"):
        LLM(llama_dir, kv_manager="buddy", preemption_mode="swap")

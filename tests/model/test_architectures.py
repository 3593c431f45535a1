"""The architectures beyond Llama's family: greedy tokens identical to transformers' in
the engine's modes, prompt logprobs within float32 tolerance, a new architecture added
by one registration line, and what they cannot do yet refused by name."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.kv.groups import kv_groups
from kvserve.model.config import llama_like_config
from kvserve.model.decoder import CausalLM
from kvserve.model.registry import MODELS, model_table, read_arch_config
from tests.helpers import NEW_ARCHS, greedy_oracle, hf_greedy, hf_logprobs, \
    prompts_of_lengths

LENGTHS = [1, 3, 17, 40, 100, 9]
MAX_NEW = 10

MODES = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 8, "block_size": 4},
    "preempt-swap": {"num_kv_blocks": 14, "block_size": 8, "preemption_mode": "swap"},
    "torch-attention": {"attention_backend": "torch", "block_size": 8},
    "buddy": {"kv_manager": "buddy", "enable_prefix_caching": False},
    "contiguous": {"kv_manager": "contiguous", "enable_prefix_caching": False,
                   "max_num_seqs": 3},
    "eager": {"enforce_eager": True, "max_num_seqs": 3},
    "ngram-spec": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
}


@pytest.fixture(scope="module")
def oracle(model_dirs):
    return greedy_oracle(model_dirs, LENGTHS, MAX_NEW)


def _greedy(model_dir: str, prompts, **settings) -> list[list[int]]:
    llm = LLM(model_dir, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.kv.stats().num_used_blocks == 0, "blocks leaked"
    llm.engine.close()
    return [o.outputs[0].token_ids for o in outs]


# every architecture in three modes in `make test`, the rest of the matrix in `make test-slow`
FAST_MODES = ("default", "chunked", "torch-attention")


@pytest.mark.parametrize("mode", [m if m in FAST_MODES else pytest.param(m, marks=pytest.mark.slow)
                                  for m in MODES])
@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_greedy_tokens_are_transformers(arch, mode, model_dirs, oracle):
    settings = dict(MODES[mode])
    groups = kv_groups(read_arch_config(model_dirs(arch)).layer_windows, None)
    if "num_kv_blocks" in settings and groups is not None and settings.get(
            "kv_manager", "paged") == "paged":
        # a block holds one KV group's layers: the same memory is more blocks
        settings["num_kv_blocks"] *= len(groups.layer_group) // groups.slots
    assert _greedy(model_dirs(arch), prompts_of_lengths(LENGTHS), **settings) == oracle(arch)


@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "phi3-longrope", "qwen2-moe", "gemma2", "gemma3"])
def test_a_shared_prefix_is_read_from_the_cache_exactly(arch, model_dirs):
    prefix = prompts_of_lengths([48], seed=3)[0]
    prompts = [prefix + tail for tail in prompts_of_lengths([5, 9, 2], seed=4)]
    want = hf_greedy(model_dirs(arch), prompts, MAX_NEW)
    llm = LLM(model_dirs(arch), block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert llm.engine.kv.stats().prefix_hits >= 2 * 40  # five full blocks, twice
    assert [o.outputs[0].token_ids for o in [first, *rest]] == want


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_prompt_logprobs_within_float32_tolerance(arch, model_dirs):
    prompt = prompts_of_lengths([30], seed=7)[0]
    llm = LLM(model_dirs(arch))
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    expected = hf_logprobs(model_dirs(arch), prompt[:1], prompt[1:])
    got = torch.tensor([entry[token].logprob
                        for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_moe_routes_each_token_to_its_top_experts_only(model_dirs):
    """At one token only the chosen experts run: their weights are the only ones read."""
    from kvserve.model.moe import SparseMoE
    llm = LLM(model_dirs("qwen3-moe"))
    moe = next(m for m in llm.engine.worker.inner.model.modules() if isinstance(m, SparseMoE))
    ran = []
    for i, expert in enumerate(moe.experts):
        expert.gate_up_proj.register_forward_hook(lambda *a, i=i: ran.append(i))
    x = torch.randn(1, moe.gate.in_features)
    chosen, weights = moe.route(x)
    moe(x)
    assert sorted(ran) == sorted(chosen[0].tolist()) and len(ran) == moe.top_k
    assert torch.allclose(weights.sum(-1), torch.ones(1))  # norm_topk_prob


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 8, "block_size": 4},
                                      {"attention_backend": "torch"}],
                         ids=["default", "chunked", "torch-attention"])
def test_dynamic_rope_generates_past_the_trained_length_as_transformers(model_dirs, settings):
    """Prompts within the 48 trained positions, generation well past them: each new
    token rotates by the length its sequence has then, as transformers does."""
    model_dir = model_dirs("llama-dynamic")
    prompts = prompts_of_lengths([10, 30, 45], seed=5)
    llm = LLM(model_dir, **settings)
    assert llm.engine.max_model_len == 4 * 48
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got == hf_greedy(model_dir, prompts, 70)


class TinyArchForCausalLM(CausalLM):
    """An architecture added in a test: Qwen3's layers under another name."""
    notes = "a test's own"

    @classmethod
    def arch_config(cls, name, cfg):
        return llama_like_config(name, cfg, qk_norm="head")


def test_an_architecture_is_one_registration_line(model_dirs, tmp_path):
    import json
    import shutil
    src = model_dirs("qwen3")
    model_dir = tmp_path / "tiny"
    shutil.copytree(src, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["TinyArchForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture.*TinyArchForCausalLM.*not supported; "
                                         "supported: LlamaForCausalLM"):
        read_arch_config(model_dir)
    MODELS.register("TinyArchForCausalLM", TinyArchForCausalLM)
    try:
        assert "| `TinyArchForCausalLM` | a test's own |" in model_table()
        prompts = prompts_of_lengths([4, 20])
        assert _greedy(str(model_dir), prompts) == hf_greedy(src, prompts, MAX_NEW)
    finally:
        MODELS.unregister("TinyArchForCausalLM")


@pytest.mark.parametrize("arch", ["mixtral", "olmo2"])
def test_tensor_parallel_refuses_what_it_does_not_split_yet(arch, model_dirs):
    from kvserve import EngineArgs
    with pytest.raises(ValueError, match="are not split across ranks yet"):
        EngineArgs(model=model_dirs(arch), tensor_parallel_size=2).create_engine_config()


def test_an_unsupported_rope_scaling_is_named(model_dirs, tmp_path):
    import json
    import shutil
    model_dir = tmp_path / "m"
    shutil.copytree(model_dirs("qwen3"), model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "mrope", "factor": 2.0}
    cfg.pop("rope_parameters", None)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope scaling type 'mrope' is not supported; "
                                         "supported: default, linear, dynamic, llama3, yarn, "
                                         "longrope"):
        read_arch_config(model_dir)

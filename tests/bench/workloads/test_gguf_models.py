"""``make-model --format gguf-*``: bench models written straight to GGUF, read by
transformers, kvserve and (slow) llama.cpp's own tools."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.experiments.gguf_decode import decode_weight_bytes
from kvserve.bench.workloads.gguf_models import _vocabulary, make_gguf_bench_model
from kvserve.bench.workloads.models import BENCH_MODELS, BenchModelSpec, make_bench_model
from kvserve.default_model import default_model_dir
from kvserve.model.gguf import prepare_gguf
from tests.format_tools import llama_cpp_source, llama_cpp_tool
from tests.helpers import prompts_of_lengths

# wider than the tokenizer (8192 ids): the vocabulary is padded, as bench-1b's is
TINY = BenchModelSpec(256, 2, 4, 2, 512, vocab_size=8320)
TINY_TIED = BenchModelSpec(256, 2, 4, 2, 512, vocab_size=8320, tied_embeddings=True)
TINY_MOE = BenchModelSpec(256, 2, 4, 2, 256, vocab_size=8320, architecture="qwen3_moe",
                          num_experts=4, experts_per_token=2)


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-bench") / "tiny-bf16.gguf"
    return make_gguf_bench_model(TINY, "tiny", "gguf-bf16", out, default_model_dir())


def test_the_1b_and_8b_shapes_are_llamas_of_their_size():
    assert BENCH_MODELS["bench-1b"].num_params() == pytest.approx(1.236e9, rel=0.01)
    assert BENCH_MODELS["bench-8b"].num_params() == pytest.approx(8.03e9, rel=0.01)


def test_a_model_too_big_for_float32_is_refused_with_the_gguf_formats_named(tmp_path):
    with pytest.raises(ValueError, match="gguf-q4_k_m"):
        make_bench_model("bench-8b", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_vocabulary_is_padded_with_unused_tokens():
    from gguf import TokenType
    tokens, types, merges = _vocabulary(default_model_dir(), 8320)
    assert len(tokens) == len(types) == 8320
    assert tokens[8200] == "[PAD8200]" and types[8200] == TokenType.UNUSED
    assert types[:100].count(TokenType.NORMAL) > 90 and merges and " " in merges[0]
    with pytest.raises(ValueError, match="past the model's vocabulary"):
        _vocabulary(default_model_dir(), 1000)


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-bench") / "tiny-moe-bf16.gguf"
    return make_gguf_bench_model(TINY_MOE, "tiny-moe", "gguf-bf16", out, default_model_dir())


@torch.inference_mode()
@pytest.mark.parametrize("which", ["llama", "qwen3_moe"])
def test_kvserve_reads_the_file_as_transformers_does(which, bf16_file, moe_file):
    from transformers import AutoConfig, AutoModelForCausalLM
    bf16_file = bf16_file if which == "llama" else moe_file
    config = AutoConfig.from_pretrained(prepare_gguf(bf16_file))
    assert (config.vocab_size, config.hidden_size, config.num_key_value_heads) == (8320, 256, 2)
    if which == "qwen3_moe":
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                config.norm_topk_prob) == (4, 2, 256, True)
    hf = AutoModelForCausalLM.from_pretrained(bf16_file.parent, gguf_file=bf16_file.name,
                                              config=config, dtype=torch.float32).eval()
    prompts = prompts_of_lengths([5, 12])
    want = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    # float activations: transformers' arithmetic (by default BF16 layers take rows rounded
    # to bfloat16, as llama.cpp's do: gguf-agreement compares that with llama.cpp)
    llm = LLM(str(bf16_file), num_kv_blocks=32, dtype="float32", gguf_activations="float")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    llm.engine.close()
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_each_weight_has_its_own_seeded_values(bf16_file, tmp_path):
    from gguf import GGUFReader
    again = make_gguf_bench_model(TINY, "tiny", "gguf-bf16", tmp_path / "again.gguf",
                                  default_model_dir())
    assert again.read_bytes() == bf16_file.read_bytes()
    tensors = {t.name: np.array(t.data) for t in GGUFReader(str(bf16_file)).tensors}
    assert not np.array_equal(tensors["blk.0.ffn_up.weight"], tensors["blk.1.ffn_up.weight"])
    values = torch.from_numpy(tensors["blk.0.ffn_up.weight"].view(np.int16)).view(
        torch.bfloat16).float()
    assert values.std().item() == pytest.approx(0.02, rel=0.05)
    assert (tensors["output_norm.weight"] == 1).all()


def test_a_decode_step_reads_the_lm_head_but_not_an_untied_embedding(bf16_file, tmp_path):
    untied = decode_weight_bytes(bf16_file)
    table = 2 * 8320 * 256
    norms = 256 * (2 * TINY.num_layers + 1)  # float32, the rest bfloat16
    assert untied["bytes_by_format"] == {"BF16": 2 * (TINY.num_params() - norms),
                                         "F32": 4 * norms}
    tied_file = make_gguf_bench_model(TINY_TIED, "tiny", "gguf-bf16", tmp_path / "tied.gguf",
                                      default_model_dir())
    tied = decode_weight_bytes(tied_file)
    everything = sum(untied["bytes_by_format"].values())
    assert untied["decode_bytes"] == everything - table
    assert tied["decode_bytes"] == sum(tied["bytes_by_format"].values()) == everything - table


def test_a_token_reads_its_routed_experts_share_of_the_expert_tensors(moe_file):
    from gguf import GGUFReader
    tensors = GGUFReader(str(moe_file)).tensors
    experts = sum(int(t.n_bytes) for t in tensors if t.name.endswith("_exps.weight"))
    table = next(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight")
    read = decode_weight_bytes(moe_file)
    assert experts == 2 * 3 * 4 * 256 * 256 * TINY_MOE.num_layers  # bf16, 3 projections
    assert read["decode_bytes"] == sum(read["bytes_by_format"].values()) - table - experts // 2


@pytest.mark.slow
@pytest.mark.parametrize("fmt, formats, spec", [("gguf-q8_0", {"Q8_0"}, TINY),
                                                ("gguf-q4_k_m", {"Q4_K", "Q6_K"}, TINY),
                                                ("gguf-q5_k_m", {"Q5_K", "Q6_K"}, TINY),
                                                ("gguf-q4_k_m", {"Q4_K", "Q6_K"}, TINY_MOE)])
def test_llama_quantize_makes_the_quantized_files(fmt, formats, spec, tmp_path):
    from gguf import GGUFReader
    tree = llama_cpp_source(Path.home() / ".cache" / "kvserve-tests" / "llama-cpp")
    out = make_gguf_bench_model(spec, "tiny", fmt, tmp_path / f"tiny-{fmt}.gguf",
                                default_model_dir(), llama_cpp_tool(tree, "llama-quantize"))
    kinds = {t.tensor_type.name for t in GGUFReader(str(out)).tensors}
    assert formats <= kinds
    assert not list(tmp_path.glob("*.tmp"))  # the bfloat16 file it was made from is gone
    llm = LLM(str(out), num_kv_blocks=32)
    out = llm.generate(prompts_of_lengths([6]), SamplingParams(temperature=0, max_tokens=4,
                                                               ignore_eos=True), use_tqdm=False)
    llm.engine.close()
    assert len(out[0].outputs[0].token_ids) == 4

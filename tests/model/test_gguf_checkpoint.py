"""GGUF files written by llama.cpp's own converter and quantizer (from llama-cpp-python's
sdist, the bench peer's source), loaded by kvserve: config and tokenizer from the
metadata, quantized weights kept as their blocks (float formats dequantized), q and k
un-permuted; greedy tokens equal to transformers loading the same file (its own GGUF
support: gguf-py's dequantization, its own un-permuting)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.gguf import GGUF_MARKER, prepare_gguf
from kvserve.model.gguf.linear import FROM_RUNS, BlockEmbedding, GGUFLinearMethod
from kvserve.model.layers import Linear
from tests.format_tools import convert_to_gguf, llama_cpp_source, quantize_gguf
from tests.helpers import prompts_of_lengths

LENGTHS = [5, 17, 30, 9]
MAX_TOKENS = 10


@pytest.fixture(scope="session")
def llama_cpp(tmp_path_factory):
    return llama_cpp_source(Path.home() / ".cache" / "kvserve-tests" / "llama-cpp")


@pytest.fixture(scope="module")
def gguf_files(llama_cpp, model_dirs, tmp_path_factory):
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, outtype: str) -> Path:
        """The converter's outtypes (f32, f16, bf16, q8_0), or llama-quantize's types
        (Q4_K_M, ...) made from the f16 file."""
        if (arch, outtype) not in cache:
            out = tmp_path_factory.mktemp("gguf") / f"{arch}-{outtype}.gguf"
            if outtype.isupper():
                cache[arch, outtype] = quantize_gguf(llama_cpp, get(arch, "f16"), outtype, out)
            else:
                cache[arch, outtype] = convert_to_gguf(llama_cpp, model_dirs(arch), outtype, out)
        return cache[arch, outtype]
    return get


@torch.inference_mode()
def transformers_greedy(path: Path) -> list[list[int]]:
    from transformers import AutoConfig, AutoModelForCausalLM
    # the config kvserve made: transformers' own conversion keeps Qwen3's default head_dim
    config = AutoConfig.from_pretrained(prepare_gguf(path))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 config=config, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts_of_lengths(LENGTHS):
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                             do_sample=False)
        outs.append(ids[0, len(prompt):].tolist())
    return outs


@pytest.mark.parametrize("arch, outtype", [
    ("llama", "q8_0"), ("qwen3", "q8_0"), ("qwen2-wide", "q8_0"), ("qwen3-moe", "q8_0"),
    pytest.param("llama", "f32", marks=pytest.mark.slow),
    pytest.param("llama", "f16", marks=pytest.mark.slow),
    pytest.param("llama", "bf16", marks=pytest.mark.slow),
    pytest.param("qwen3", "bf16", marks=pytest.mark.slow),
    pytest.param("llama-256", "Q4_K_M", marks=pytest.mark.slow),
    pytest.param("llama-256", "Q5_K_M", marks=pytest.mark.slow),
    pytest.param("qwen3-moe-256", "Q4_K_M", marks=pytest.mark.slow)])
def test_greedy_tokens_equal_transformers_on_the_same_file(arch, outtype, gguf_files):
    """With the float products of dequantize-then-multiply (as transformers computes);
    the int8 activations llama.cpp uses are compared with llama.cpp itself."""
    path = gguf_files(arch, outtype)
    llm = LLM(str(path), num_kv_blocks=64, dtype="float32", gguf_activations="float")
    outs = llm.generate(prompts_of_lengths(LENGTHS),
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == transformers_greedy(path)


def block_formats(model, as_stored: bool = False) -> set[str]:
    """The weights' formats: the file's, or (``as_stored``) runs of four rows where the
    layers keep them so."""
    kinds = {kind for m in model.modules() if isinstance(m, Linear)
             for kind in getattr(m.method, "kinds", [])}
    if isinstance(model.model.embed_tokens, BlockEmbedding):
        kinds.add(model.model.embed_tokens.kind)
    return kinds if as_stored else {FROM_RUNS.get(kind, kind) for kind in kinds}


def test_quantized_weights_stay_blocks_with_no_float_copy(gguf_files):
    llm = LLM(str(gguf_files("llama", "q8_0")), num_kv_blocks=64, dtype="float32")
    model = llm.engine.worker.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.method, GGUFLinearMethod) and m.weight is None
                           for m in linears)
    assert block_formats(model) == {"Q8_0"}
    # what is float is the norms (and the embedding, when the file keeps it float)
    floats = sum(p.numel() for p in model.parameters())
    blocks = sum(b.numel() for name, b in model.named_buffers() if "gguf" in name)
    assert floats * 4 < blocks / 2


@pytest.mark.parametrize("arch, outtype, kinds", [
    ("qwen3-moe", "q8_0", {"Q8_0"}),
    pytest.param("qwen3-moe-256", "Q4_K_M", {"Q4_K", "Q6_K"}, marks=pytest.mark.slow)])
def test_each_expert_computes_on_its_own_blocks(gguf_files, arch, outtype, kinds):
    """A mixture of experts' projections, one tensor of all experts in the file, become
    each expert's own layer on that expert's rows of blocks."""
    from kvserve.model.moe import SparseMoE
    llm = LLM(str(gguf_files(arch, outtype)), num_kv_blocks=64, dtype="float32")
    model = llm.engine.worker.model
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(len(m.experts) == 4 for m in moes)
    for moe in moes:
        for expert in moe.experts:
            for layer in (expert.gate_up_proj, expert.down_proj):
                assert isinstance(layer.method, GGUFLinearMethod) and layer.weight is None
                assert {FROM_RUNS.get(k, k) for k in layer.method.kinds} <= kinds
    rows = {tuple(e.gate_up_proj.gguf_part0[:2].flatten().tolist()) for e in moes[0].experts}
    assert len(rows) == 4  # four experts, four different weights


@pytest.mark.parametrize("outtype, kind", [("bf16", "BF16"),
                                           pytest.param("f16", "F16", marks=pytest.mark.slow)])
def test_16_bit_float_weights_stay_two_bytes_a_weight(gguf_files, outtype, kind):
    llm = LLM(str(gguf_files("llama", outtype)), num_kv_blocks=64, dtype="float32")
    model = llm.engine.worker.model
    assert block_formats(model) == {kind}
    stored = {name: b for name, b in model.named_buffers() if "gguf" in name}
    assert stored and all(b.dtype == torch.uint8 for b in stored.values())
    up = model.model.layers[0].mlp.gate_up_proj
    assert up.gguf_part0.shape == (up.out_features // 2, 2 * up.in_features)


@pytest.mark.slow
def test_a_q4_k_m_file_mixes_formats_and_keeps_them(gguf_files):
    llm = LLM(str(gguf_files("llama-256", "Q4_K_M")), num_kv_blocks=64, dtype="float32")
    assert {"Q4_K", "Q6_K"} <= block_formats(llm.engine.worker.model)
    assert {"Q4_K_X4", "Q6_K_X4"} <= block_formats(llm.engine.worker.model, as_stored=True)


def test_the_prepared_directory_is_made_once_per_file(gguf_files, model_dirs):
    path = gguf_files("llama", "q8_0")
    first = prepare_gguf(path)
    assert prepare_gguf(path) == first
    marker = json.loads((first / GGUF_MARKER).read_text())
    assert marker["file"] == str(path.resolve()) and marker["architecture"] == "llama"
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    from kvserve.model.tokenizer import Tokenizer
    text = "def add(a, b):\n    return a + b"
    assert Tokenizer(first).encode(text) == Tokenizer(model_dirs("llama")).encode(text)


def test_each_stored_format_has_its_own_tuning_plan(gguf_files, model_dirs):
    """A plan's measured choices hold for one storage: the key tells formats apart."""
    from kvserve.model.gguf.checkpoint import stored_format
    q8_0, bf16 = (prepare_gguf(gguf_files("llama", kind)) for kind in ("q8_0", "bf16"))
    formats = {stored_format(q8_0, "int8"), stored_format(bf16, "int8"),
               stored_format(q8_0, "float")}
    assert len(formats) == 3 and None not in formats
    assert stored_format(Path(model_dirs("llama")), "int8") is None


def test_files_it_cannot_read_are_named(tmp_path):
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf file")
    with pytest.raises(FileNotFoundError, match="neither a directory nor a GGUF file"):
        LLM(str(bogus))


def test_a_tokenizer_directory_replaces_the_files_own(gguf_files, model_dirs, tmp_path):
    from kvserve.model.tokenizer import Tokenizer
    from tests.helpers import build_tokenizer
    other = build_tokenizer(tmp_path)  # trained alike: the same tokens, another directory
    llm = LLM(str(gguf_files("llama", "q8_0")), num_kv_blocks=64, tokenizer=other)
    assert llm.engine.config.model.tokenizer_path == Path(other)
    text = "def add(a, b):\n    return a + b"
    assert llm.get_tokenizer().encode(text) == Tokenizer(Path(other)).encode(text)
    with pytest.raises(ValueError, match="is not a directory holding a tokenizer.json"):
        LLM(str(gguf_files("llama", "q8_0")), tokenizer=str(tmp_path / "none"))

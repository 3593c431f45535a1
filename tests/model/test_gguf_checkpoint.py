"""GGUF files written by llama.cpp's own converter (from llama-cpp-python's sdist, the
bench peer's source), loaded by kvserve: config and tokenizer from the metadata, the
weights dequantized and un-permuted; greedy tokens equal to transformers loading the same
file (its own GGUF support: gguf-py's dequantization, its own un-permuting)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.gguf import GGUF_MARKER, prepare_gguf
from tests.helpers import convert_to_gguf, llama_cpp_source, prompts_of_lengths

LENGTHS = [5, 17, 30, 9]
MAX_TOKENS = 10


@pytest.fixture(scope="session")
def llama_cpp(tmp_path_factory):
    return llama_cpp_source(Path.home() / ".cache" / "kvserve-tests" / "llama-cpp")


@pytest.fixture(scope="module")
def gguf_files(llama_cpp, model_dirs, tmp_path_factory):
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, outtype: str) -> Path:
        if (arch, outtype) not in cache:
            out = tmp_path_factory.mktemp("gguf") / f"{arch}-{outtype}.gguf"
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
    ("llama", "q8_0"), ("qwen3", "q8_0"), ("qwen2-wide", "q8_0"),
    pytest.param("llama", "f32", marks=pytest.mark.slow),
    pytest.param("llama", "f16", marks=pytest.mark.slow),
    pytest.param("llama", "bf16", marks=pytest.mark.slow),
    pytest.param("qwen3", "bf16", marks=pytest.mark.slow)])
def test_greedy_tokens_equal_transformers_on_the_same_file(arch, outtype, gguf_files):
    path = gguf_files(arch, outtype)
    llm = LLM(str(path), num_kv_blocks=64, dtype="float32")
    outs = llm.generate(prompts_of_lengths(LENGTHS),
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == transformers_greedy(path)


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


def test_files_it_cannot_read_are_named(tmp_path):
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf file")
    with pytest.raises(FileNotFoundError, match="neither a directory nor a GGUF file"):
        LLM(str(bogus))

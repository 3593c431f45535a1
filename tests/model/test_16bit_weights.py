"""A 16-bit checkpoint on a CPU without bf16 hardware (dtype auto): its linear layers and
token embedding keep the checkpoint's two bytes a weight, computed in float32 by the
kernels that run a GGUF file's BF16/F16 rows; an explicit float32 widens them at load."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.gguf.linear import FROM_RUNS, BlockEmbedding, GGUFLinearMethod
from kvserve.model.linear_method import FloatLinearMethod
from tests.helpers import hf_greedy, prompts_of_lengths

LENGTHS = [5, 17, 30]
TOKENS = 8


@pytest.fixture(scope="module")
def sixteen_bit_dirs(model_dirs, tmp_path_factory):
    """(arch, "bfloat16" | "float16") -> the tiny model saved by transformers in that dtype."""
    from transformers import AutoModelForCausalLM
    made: dict[tuple[str, str], str] = {}

    def make(arch: str, dtype: str) -> str:
        if (arch, dtype) not in made:
            src = Path(model_dirs(arch))
            out = tmp_path_factory.mktemp(f"{arch}-{dtype}")
            model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
            model.save_pretrained(out)
            for f in src.glob("*token*"):
                shutil.copy(f, out / f.name)
            made[arch, dtype] = str(out)
        return made[arch, dtype]
    return make


@pytest.fixture
def no_bf16_hardware(monkeypatch):
    monkeypatch.setattr("kvserve.model.loader.cpu_has_bf16", lambda: False)


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts_of_lengths(LENGTHS)],
                        SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch, dtype", [("llama", "bfloat16"), ("llama3-tied", "bfloat16"),
                                         ("qwen3", "float16"), ("gpt2", "bfloat16")])
def test_greedy_tokens_equal_transformers_in_float32_on_the_same_weights(
        sixteen_bit_dirs, no_bf16_hardware, arch, dtype):
    model_dir = sixteen_bit_dirs(arch, dtype)
    llm = LLM(model_dir, num_kv_blocks=64)
    assert llm.engine.config.model.dtype == torch.float32
    assert greedy(llm) == hf_greedy(model_dir, prompts_of_lengths(LENGTHS), TOKENS)
    model = llm.engine.worker.model
    kind = {"bfloat16": "BF16", "float16": "F16"}[dtype]
    kept = [m for m in model.modules() if isinstance(getattr(m, "method", None),
                                                     GGUFLinearMethod)]
    if arch == "gpt2":  # its Conv1D weights are stored transposed: widened at load
        assert not kept
        return
    # (BF16 in runs of rows where the kernels have AVX512-BF16: the same bytes)
    assert kept and all({FROM_RUNS.get(k, k) for k in m.method.kinds} == {kind} for m in kept)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.gguf_part0.dtype == torch.uint8
    assert qkv.gguf_part0.shape[1] == 2 * qkv.in_features  # two bytes a weight
    assert isinstance(model.model.embed_tokens, BlockEmbedding)
    assert FROM_RUNS.get(model.model.embed_tokens.kind, model.model.embed_tokens.kind) == kind
    if arch == "llama3-tied":  # the head computes on the embedding's rows, not a copy
        assert model.lm_head.gguf_part0.data_ptr() == \
            model.model.embed_tokens.gguf_blocks.data_ptr()


def test_an_explicit_float32_widens_the_weights_at_load(sixteen_bit_dirs, no_bf16_hardware):
    llm = LLM(sixteen_bit_dirs("llama", "bfloat16"), num_kv_blocks=64, dtype="float32")
    qkv = llm.engine.worker.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, FloatLinearMethod) and qkv.weight.dtype == torch.float32


def test_bf16_hardware_computes_in_bfloat16(sixteen_bit_dirs, monkeypatch):
    from kvserve.model.loader import keeps_16bit_weights
    from kvserve.model.registry import read_arch_config
    arch = read_arch_config(Path(sixteen_bit_dirs("llama", "bfloat16")))
    monkeypatch.setattr("kvserve.model.loader.cpu_has_bf16", lambda: True)
    assert not keeps_16bit_weights("auto", arch)
    monkeypatch.setattr("kvserve.model.loader.cpu_has_bf16", lambda: False)
    assert keeps_16bit_weights("auto", arch)
    assert not keeps_16bit_weights("auto", arch, quantization="int8")
    assert not keeps_16bit_weights("float32", arch)
    assert not keeps_16bit_weights("auto", arch, device="cuda")

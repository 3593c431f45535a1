"""compressed-tensors checkpoints made by llmcompressor's own GPTQ (in a venv of its own),
loaded by kvserve: greedy tokens equal to transformers loading the same checkpoint
(compressed-tensors decompresses it: each weight dequantized, then multiplied; for W8A8
each token's activations rounded to int8 as well); the 4-bit weights kept at 4 bits;
W8A8 layer outputs within a stated tolerance of compressed-tensors' own; what cannot
combine with such a checkpoint refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.model.compressed import Int4LinearMethod
from kvserve.model.quantization import Int8LinearMethod
from tests.format_tools import compress_checkpoint, llmcompressor_python
from tests.helpers import W8A8_TOLERANCE, prompts_of_lengths, w8a8_logprob_differences

pytestmark = pytest.mark.slow
LENGTHS = [5, 17, 30, 9]  # prompts of more than 8 rows run the dequantized tiles
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoints(model_dirs, tmp_path_factory):
    python = llmcompressor_python(Path.home() / ".cache" / "kvserve-tests" / "llmcompressor")
    cache: dict[str, str] = {}

    def get(scheme: str) -> str:
        if scheme not in cache:  # hidden 256: whole groups of 128
            cache[scheme] = compress_checkpoint(python, model_dirs("llama-256"), scheme,
                                                tmp_path_factory.mktemp(scheme))
        return cache[scheme]
    return get


def transformers_model(model_dir: str):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    config = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]
    asymmetric = any(not (group["weights"] or {}).get("symmetric", True)
                     for group in config["config_groups"].values())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 ignore_mismatched_sizes=asymmetric).eval()
    if asymmetric:
        # transformers 5.25 shapes the zero points as if unpacked and refuses the
        # checkpoint's (eight rows a word); compressed-tensors' decompression unpacks them
        with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
            for name, module in model.named_modules():
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point = nn.Parameter(
                        f.get_tensor(f"{name}.weight_zero_point"), requires_grad=False)
    return model


@torch.inference_mode()
def transformers_greedy(model_dir: str) -> list[list[int]]:
    model = transformers_model(model_dir)
    outs = []
    for prompt in prompts_of_lengths(LENGTHS):
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
        outs.append(ids[0, len(prompt):].tolist())
    return outs


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W8A8"])
def test_greedy_tokens_equal_transformers_on_the_same_checkpoint(checkpoints, scheme):
    model_dir = checkpoints(scheme)
    llm = LLM(model_dir, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts_of_lengths(LENGTHS)],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == transformers_greedy(model_dir)
    method = Int4LinearMethod if scheme.startswith("W4") else Int8LinearMethod
    model = llm.engine.worker.model
    layers = [m for name, m in model.named_modules() if hasattr(m, "method")
              and name != "lm_head"]
    assert layers and all(isinstance(m.method, method) and m.weight is None for m in layers)
    if scheme.startswith("W4"):  # half a byte a weight, a scale and a zero a group of 128
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert qkv.codes.dtype == torch.uint8 and qkv.codes.shape[1] * 2 == qkv.in_features
        assert qkv.scales.shape == (qkv.out_features, qkv.in_features // 128)


def test_w8a8_logprobs_stay_within_a_stated_tolerance_of_compressed_tensors(checkpoints):
    model_dir = checkpoints("W8A8")
    diffs = w8a8_logprob_differences(transformers_model(model_dir),
                                     LLM(model_dir, num_kv_blocks=64),
                                     prompts_of_lengths(LENGTHS), MAX_TOKENS)
    print(f"W8A8 logprob differences: median {diffs.median():.4f}, worst {diffs.max():.4f}")
    assert diffs.median() < W8A8_TOLERANCE["median"] and diffs.max() < W8A8_TOLERANCE["worst"]


def test_quantization_cannot_be_asked_of_a_compressed_checkpoint(checkpoints):
    with pytest.raises(ValueError, match="compressed-tensors W4A16 checkpoint.*--quantization"):
        LLM(checkpoints("W4A16"), quantization="int8")


def test_its_tuning_plan_is_its_own(checkpoints, model_dirs):
    from kvserve.model.compressed.scheme import stored_format
    assert stored_format(model_dirs("llama-256")) is None
    assert "W4A16" in stored_format(checkpoints("W4A16"))
    assert stored_format(checkpoints("W4A16")) != stored_format(checkpoints("W4A16_ASYM"))
    assert json.loads((Path(checkpoints("W8A8")) / "config.json").read_text())[
        "quantization_config"]["format"] == "int-quantized"

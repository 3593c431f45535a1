"""GPTQ and AWQ checkpoints made by GPTQModel (in a venv of its own), loaded by kvserve:
greedy tokens equal to transformers reading the same checkpoint (each layer dequantized
by GPTQModel in float32, then multiplied; its CPU kernel would multiply in bfloat16),
act-order (desc_act) groups included; the weights kept at 4 bits."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.compressed import Int4LinearMethod
from tests.format_tools import gptq_checkpoint, gptqmodel_python, transformers_greedy_in
from tests.helpers import prompts_of_lengths

pytestmark = pytest.mark.slow
LENGTHS = [5, 17, 30, 9]  # prompts of more than 8 rows run the dequantized tiles
MAX_TOKENS = 10
# (method, architecture, group, symmetric, desc_act, checkpoint format)
VARIANTS = {
    "gptq-act-order": ("gptq", "llama-256", 64, True, True, "gptq"),
    "gptq-asymmetric": ("gptq", "llama-256", 32, False, False, "gptq"),
    "gptq-v2-act-order": ("gptq", "llama-256", 64, False, True, "gptq_v2"),
    "awq": ("awq", "llama-256", 64, False, False, "gemm"),
    "awq-symmetric": ("awq", "llama-256", 32, True, False, "gemm"),
}


@pytest.fixture(scope="module")
def tool():
    return gptqmodel_python(Path.home() / ".cache" / "kvserve-tests" / "gptqmodel")


@pytest.fixture(scope="module")
def checkpoints(tool, model_dirs, tmp_path_factory):
    cache: dict[str, str] = {}

    def get(variant: str) -> str:
        if variant not in cache:
            method, arch, group, symmetric, desc_act, fmt = VARIANTS[variant]
            cache[variant] = gptq_checkpoint(tool, model_dirs(arch),
                                             tmp_path_factory.mktemp(variant), method, group,
                                             symmetric, desc_act, fmt)
        return cache[variant]
    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_transformers_on_the_same_checkpoint(tool, checkpoints, variant):
    model_dir = checkpoints(variant)
    prompts = prompts_of_lengths(LENGTHS)
    llm = LLM(model_dir, num_kv_blocks=64, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == transformers_greedy_in(
        tool, model_dir, prompts, MAX_TOKENS)
    model = llm.engine.worker.model
    layers = [m for name, m in model.named_modules() if hasattr(m, "method")
              and name != "lm_head"]
    assert layers and all(isinstance(m.method, Int4LinearMethod) and m.weight is None
                          for m in layers)
    qkv = model.model.layers[0].self_attn.qkv_proj
    group = VARIANTS[variant][2]
    assert qkv.codes.dtype == torch.uint8 and qkv.codes.shape[1] * 2 == qkv.in_features
    assert qkv.scales.shape == (qkv.out_features, qkv.in_features // group)
    act_order = VARIANTS[variant][4]
    assert (qkv.perm is not None) == act_order  # the columns gathered into their groups


def test_what_cannot_combine_with_such_a_checkpoint_is_refused(checkpoints):
    with pytest.raises(ValueError, match="GPTQ W4A16 checkpoint.*--quantization"):
        LLM(checkpoints("gptq-asymmetric"), quantization="int8")

"""``make-model --format ct-*``: bench models written straight as compressed-tensors
checkpoints, packed as compressed-tensors packs and read by transformers (through
compressed-tensors) and kvserve alike."""
from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.workloads.compressed_models import int4_group_packed, \
    make_compressed_bench_model
from kvserve.bench.workloads.models import BenchModelSpec
from kvserve.default_model import default_model_dir
from kvserve.model.compressed.scheme import Scheme, read_compressed_config
from tests.helpers import W8A8_TOLERANCE, prompts_of_lengths, w8a8_logprob_differences

TINY = BenchModelSpec(256, 2, 4, 2, 512, vocab_size=8320)
LENGTHS = [5, 17, 30]


def test_the_4_bit_codes_are_packed_as_compressed_tensors_packs_them():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(1))
    packed, scales = int4_group_packed(w)
    codes = torch.round(w.reshape(24, 2, 128) / scales[..., None]).clamp(-8, 7)
    assert torch.equal(packed, pack_to_int32(codes.reshape(24, 256).to(torch.int8), 4))
    assert torch.equal(scales, w.reshape(24, 2, 128).abs().amax(-1) / 7.5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    def make(fmt: str):
        out = tmp_path_factory.mktemp(fmt) / "tiny"
        return make_compressed_bench_model(TINY, "tiny", fmt, out, default_model_dir(),
                                           progress=False)
    return make


def written_and_read(checkpoint, fmt: str, scheme: Scheme):
    """The checkpoint ``fmt``, checked as written; transformers' model of it and kvserve's."""
    from transformers import AutoModelForCausalLM
    out = checkpoint(fmt)
    config = read_compressed_config(out)
    assert config.scheme_for("model.layers.1.mlp.down_proj") == scheme
    assert config.scheme_for("lm_head") is None
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["lm_head.weight"] == "model-00002.safetensors"
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return reference, LLM(str(out), num_kv_blocks=64)


def assert_greedy_tokens_equal(reference, llm) -> None:
    prompts = prompts_of_lengths(LENGTHS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    with torch.inference_mode():
        want = [reference.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                                   min_new_tokens=8)[0, len(p):].tolist() for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want


def test_kvserve_and_transformers_read_the_w4a16_checkpoint_alike(checkpoint):
    reference, llm = written_and_read(checkpoint, "ct-w4a16", Scheme("w4a16", group=128))
    assert_greedy_tokens_equal(reference, llm)


def test_kvserve_and_transformers_read_the_w8a8_checkpoint_alike(checkpoint):
    """int8 activations: logprobs within the stated tolerance, not greedy identity."""
    reference, llm = written_and_read(checkpoint, "ct-w8a8", Scheme("w8a8"))
    diffs = w8a8_logprob_differences(reference, llm, prompts_of_lengths(LENGTHS), 8)
    assert diffs.median() < W8A8_TOLERANCE["median"] and diffs.max() < W8A8_TOLERANCE["worst"]


def test_a_shape_not_in_whole_groups_is_refused(tmp_path):
    with pytest.raises(ValueError, match="whole groups of 128"):
        make_compressed_bench_model(BenchModelSpec(192, 1, 3, 1, 512, vocab_size=8320),
                                    "odd", "ct-w4a16", tmp_path / "odd", default_model_dir())
    with pytest.raises(ValueError, match="one of ct-w8a8, ct-w4a16"):
        make_compressed_bench_model(TINY, "tiny", "ct-fp8", tmp_path / "x", default_model_dir())


def test_a_bfloat16_checkpoint_is_written_one_tensor_at_a_time(checkpoint, monkeypatch):
    """hf-bf16: every weight bfloat16, no quantization_config; kvserve (keeping the
    16-bit weights, as on a CPU without bf16 hardware) and transformers in float32 agree."""
    from transformers import AutoModelForCausalLM
    from safetensors import safe_open
    out = checkpoint("hf-bf16")
    assert read_compressed_config(out) is None
    with safe_open(str(out / "model-00000.safetensors"), framework="pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}
    monkeypatch.setattr("kvserve.model.loader.cpu_has_bf16", lambda: False)
    llm = LLM(str(out), num_kv_blocks=64)
    assert llm.engine.config.model.weights_16bit
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert_greedy_tokens_equal(reference, llm)

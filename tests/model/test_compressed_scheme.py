"""Reading a compressed-tensors quantization_config (kvserve/model/compressed/scheme.py):
the schemes kvserve computes, which layers they cover (targets, ignore), and the
configurations it refuses, each named."""
from __future__ import annotations

import copy
import json

import pytest

from kvserve.model.compressed.scheme import Scheme, read_compressed_config

# as llmcompressor 0.14 writes them (GPTQ, scheme W4A16_ASYM / W8A8)
W4A16_ASYM = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"], "sparsity_config": {},
    "transform_config": {}, "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "format": "pack-quantized", "targets": ["Linear"], "input_activations": None,
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                    "symmetric": False, "actorder": "static", "block_structure": None}}}}
W8A8 = {
    "quant_method": "compressed-tensors", "format": "int-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head", "re:.*down_proj"],
    "config_groups": {"group_0": {
        "format": "int-quantized", "targets": ["Linear"],
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                              "dynamic": True, "symmetric": True},
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}}
# as GPTQModel and AutoAWQ write them
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": True,
        "checkpoint_format": "gptq", "pack_dtype": "int32", "lm_head": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
       "version": "gemm", "modules_to_not_convert": None}


def write(tmp_path, quantization_config):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "quantization_config": quantization_config}))
    return tmp_path


def test_the_schemes_and_the_layers_they_cover(tmp_path):
    w4 = read_compressed_config(write(tmp_path, W4A16_ASYM))
    assert w4.scheme_for("model.layers.0.self_attn.q_proj") == Scheme("w4a16", 128, False)
    assert w4.scheme_for("lm_head") is None
    w8 = read_compressed_config(write(tmp_path, W8A8))
    assert w8.scheme_for("model.layers.3.mlp.gate_proj") == Scheme("w8a8")
    assert w8.scheme_for("model.layers.3.mlp.down_proj") is None  # ignored by a regex
    assert w8.describe() == "compressed-tensors W8A8"


def test_a_checkpoint_without_quantization_config_is_plain(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert read_compressed_config(tmp_path) is None


def changed(config, path, value):
    config = copy.deepcopy(config)
    *keys, last = path
    node = config
    for key in keys:
        node = node[key]
    node[last] = value
    return config


WEIGHTS = ("config_groups", "group_0", "weights")


@pytest.mark.parametrize("config, message", [
    (changed(W4A16_ASYM, ("quant_method",), "bitsandbytes"),
     "quant_method 'bitsandbytes' is not supported"),
    (changed(W4A16_ASYM, (*WEIGHTS, "actorder"), "group"), "actorder 'group'"),
    (changed(W4A16_ASYM, (*WEIGHTS, "group_size"), 48), "group_size 48"),
    (changed(W4A16_ASYM, (*WEIGHTS, "num_bits"), 8), "pack-quantized weights of 8 bits"),
    (changed(W4A16_ASYM, (*WEIGHTS, "type"), "float"), "weights of type 'float'"),
    (changed(W4A16_ASYM, ("quantization_status",), "frozen"), "only compressed"),
    (changed(W4A16_ASYM, ("sparsity_config",), {"format": "sparse-24"}), "sparsity_config"),
    (changed(W8A8, ("config_groups", "group_0", "input_activations", "dynamic"), False),
     "int-quantized input activations"),
    (changed(W8A8, ("config_groups", "group_0", "format"), "float-quantized"),
     "format 'float-quantized'"),
])
def test_what_it_cannot_compute_is_refused_naming_what_it_can(tmp_path, config, message):
    with pytest.raises(ValueError, match=message) as e:
        read_compressed_config(write(tmp_path, config))
    assert "supported" in str(e.value)


@pytest.mark.parametrize("config, message", [
    (changed(GPTQ, ("bits",), 8), "gptq quantization_config: bits 8"),
    (changed(GPTQ, ("group_size",), 48), "group_size 48"),
    (changed(GPTQ, ("checkpoint_format",), "marlin"), "checkpoint_format 'marlin'"),
    (changed(GPTQ, ("dynamic",), {"-:.*mlp": {}}), "dynamic"),
    (changed(GPTQ, ("lm_head",), True), "lm_head True"),
    (changed(AWQ, ("version",), "gemv"), "awq quantization_config: version 'gemv'"),
])
def test_gptq_and_awq_it_cannot_compute_are_refused(tmp_path, config, message):
    with pytest.raises(ValueError, match=message) as e:
        read_compressed_config(write(tmp_path, config))
    assert "supported" in str(e.value)


def test_gptq_and_awq_schemes(tmp_path):
    gptq = read_compressed_config(write(tmp_path, GPTQ))
    assert gptq.scheme_for("model.layers.0.mlp.up_proj") == Scheme("w4a16", 64, True, True)
    assert gptq.scheme_for("lm_head") is None
    assert gptq.zeros_stored_minus_one and gptq.marker == "qweight"
    assert gptq.describe() == "GPTQ W4A16"
    v2 = read_compressed_config(write(tmp_path, changed(GPTQ, ("checkpoint_format",),
                                                        "gptq_v2")))
    assert not v2.zeros_stored_minus_one
    channel = read_compressed_config(write(tmp_path, changed(GPTQ, ("group_size",), -1)))
    assert channel.scheme_for("model.layers.0.mlp.up_proj").group is None
    awq = read_compressed_config(write(tmp_path, changed(AWQ, ("modules_to_not_convert",),
                                                         ["mlp.gate"])))
    assert awq.scheme_for("model.layers.1.self_attn.o_proj") == Scheme("w4a16", 64, False)
    assert awq.scheme_for("model.layers.1.mlp.gate_proj") is None  # a name that contains it
    assert not awq.zeros_stored_minus_one and awq.describe() == "AWQ W4A16"
    no_zeros = read_compressed_config(write(tmp_path, changed(AWQ, ("zero_point",), False)))
    assert no_zeros.scheme_for("model.layers.1.mlp.up_proj") == Scheme("w4a16", 64, True)

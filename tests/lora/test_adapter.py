"""What an adapter directory may hold, checked when it is added: each refusal names the
file, the module or the setting, and what would be allowed."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.lora.registry import LoRARegistry
from kvserve.config.lora import LoRAConfig
from kvserve.model.registry import read_arch_config
from pathlib import Path


@pytest.fixture
def registry(model_dirs):
    return LoRARegistry(LoRAConfig(max_loras=2, max_lora_rank=8),
                        read_arch_config(Path(model_dirs("llama"))))


def copy_adapter(src: str, dst: Path, config: dict | None = None, tensors=None) -> str:
    shutil.copytree(src, dst)
    if config is not None:
        path = dst / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        weights = dst / "adapter_model.safetensors"
        save_file(tensors(load_file(str(weights))), str(weights))
    return str(dst)


def test_a_good_adapter_is_added_once(registry, lora_adapters):
    request = LoRARequest("a", 1, lora_adapters("llama")[0])
    assert registry.add(request) and not registry.add(request)
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'a'"):
        registry.add(LoRARequest("b", 1, lora_adapters("llama")[1]))
    with pytest.raises(ValueError, match="adapter named 'a' is already loaded"):
        registry.add(LoRARequest("a", 2, lora_adapters("llama")[1]))


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"bias": "lora_only"}, "bias='lora_only' is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported; supported: LORA"),
])
def test_what_plain_lora_is_not_is_refused(registry, lora_adapters, tmp_path, change, message):
    path = copy_adapter(lora_adapters("llama")[0], tmp_path / "a", change)
    with pytest.raises(ValueError, match=message):
        registry.check(LoRARequest("a", 1, path))


def test_a_rank_above_the_maximum_names_the_setting(registry, lora_adapters):
    with pytest.raises(ValueError, match="rank 16 .* exceeds max_lora_rank 8; raise "
                                         "--max-lora-rank"):
        registry.check(LoRARequest("a", 1, lora_adapters("llama")[3]))


def test_an_adapter_of_another_shape_is_refused(registry, lora_adapters, tmp_path):
    wider = copy_adapter(lora_adapters("llama")[0], tmp_path / "a", tensors=lambda t: {
        k: (v.repeat(2, 1) if k.endswith("o_proj.lora_B.weight") else v) for k, v in t.items()})
    with pytest.raises(ValueError, match=r"o_proj has A \(4, 64\) and B \(128, 4\); the base "
                                         "model's layer takes 64 inputs and gives 64 outputs"):
        registry.check(LoRARequest("a", 1, wider))


def test_missing_files_and_modules_are_named(registry, lora_adapters, tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        registry.check(LoRARequest("a", 1, str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        registry.check(LoRARequest("a", 1, str(tmp_path / "empty")))
    only_a = copy_adapter(lora_adapters("llama")[0], tmp_path / "only-a", tensors=lambda t: {
        k: v for k, v in t.items() if "lora_B" not in k})
    with pytest.raises(ValueError, match="has lora_A but not both A and B"):
        registry.check(LoRARequest("a", 1, only_a))
    head = copy_adapter(lora_adapters("llama")[0], tmp_path / "head", tensors=lambda t: {
        **t, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(512, 4)})
    with pytest.raises(ValueError, match="no LoRA-capable layer .* not embeddings, the LM head"):
        registry.check(LoRARequest("a", 1, head))


def test_requests_for_adapters_need_lora_enabled(model_dirs, lora_adapters):
    llm = LLM(model_dirs("llama"), num_kv_blocks=50)
    with pytest.raises(ValueError, match="not enabled: start the engine with enable_lora"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("a", 1, lora_adapters("llama")[0]))
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_adapter_leaves_no_request_behind(model_dirs, tmp_path):
    llm = LLM(model_dirs("llama"), num_kv_blocks=50, enable_lora=True)
    with pytest.raises(ValueError, match="is not a directory"):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=2),
                     lora_request=[None, LoRARequest("a", 1, str(tmp_path / "x"))])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_settings_are_checked_where_written():
    from kvserve import EngineArgs
    with pytest.raises(ValueError, match=r"max_loras must be an integer in \[1, 256\]"):
        EngineArgs(enable_lora=True, max_loras=300)
    with pytest.raises(ValueError, match="max_lora_rank must be an integer in"):
        EngineArgs(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="max_cpu_loras .* must be at least max_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("a", 0, "/x")

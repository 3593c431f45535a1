"""Loading HF checkpoints: sharded files, dtypes, and clear errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.model.config import ArchConfig
from kvserve.model.registry import read_arch_config
from kvserve.model.loader import resolve_dtype
from tests.helpers import hf_greedy, prompts_of_lengths


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _greedy(model_dir, prompts, **kw):
    llm = LLM(str(model_dir), **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_sharded_checkpoint(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "sharded")
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompts = prompts_of_lengths([4, 19])
    assert _greedy(d, prompts) == hf_greedy(llama_dir, prompts, 8)


def test_missing_shard_is_named(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}}))
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        LLM(str(d))


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_named(llama_dir, tmp_path, missing):
    d = _copy(llama_dir, tmp_path / "m")
    (d / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing.split(".")[0]):
        LLM(str(d))


def test_pickled_weights_refused(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(ValueError, match="safetensors only"):
        LLM(str(d))


def test_unknown_architecture_lists_supported(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FalconForCausalLM.*supported: LlamaForCausalLM"):
        LLM(str(d))


def test_shape_mismatch_names_tensor(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj.weight.*\(3, 3\)"):
        LLM(str(d))


def test_missing_tensor_is_named(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        LLM(str(d))


def test_dtype_auto_is_float32_without_bf16_hardware(llama_dir, monkeypatch):
    cfg = read_arch_config(llama_dir)
    bf16_cfg = ArchConfig(**{**cfg.__dict__, "torch_dtype": "bfloat16"})
    monkeypatch.setattr("kvserve.model.loader.cpu_has_bf16", lambda: False)
    assert resolve_dtype("auto", bf16_cfg) == torch.float32
    monkeypatch.setattr("kvserve.model.loader.cpu_has_bf16", lambda: True)
    assert resolve_dtype("auto", bf16_cfg) == torch.bfloat16
    assert resolve_dtype("float16", cfg) == torch.float16


def test_bfloat16_runs(llama_dir):
    out = _greedy(llama_dir, prompts_of_lengths([6]), dtype="bfloat16")
    assert len(out[0]) == 8


def test_chat_template_and_tokenizer(llama_dir):
    llm = LLM(llama_dir)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "def f(x):"}])
    assert text == "<|user|>\ndef f(x):\n<|assistant|>\n"
    ids = tok.encode("def f(x): return x")
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "def f(x): return x"
    out = llm.chat([{"role": "user", "content": "def f(x):"}],
                   SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


START_UP_IMPORTS = """
import sys
from kvserve import LLM
from kvserve.default_model import default_model_dir
LLM(default_model_dir()).engine.close()
print(sorted(m for m in ("torch._dynamo", "sympy", "triton") if m in sys.modules))
"""


def test_making_an_engine_imports_no_compiler_stack():
    """Building the model on the meta device and materialising it go by shape: torch's
    meta-tensor paths (an Embedding's init, arange, empty_like) would import its
    compiler and symbolic-shape machinery, seconds of a fresh process's start-up."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", START_UP_IMPORTS], capture_output=True,
                         text=True, check=True, timeout=300).stdout
    assert out.strip().splitlines()[-1] == "[]", out

"""make_bench_model: a tiny custom spec loads with transformers with the requested shapes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kvserve.bench.workloads.models import BenchModelSpec, make_bench_model, model_vocab


def test_tiny_model_loads_with_requested_shapes(tiny_model_dir: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(tiny_model_dir))
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (32, 2, 4)
    assert cfg.num_key_value_heads == 2 and cfg.intermediate_size == 64
    assert cfg.vocab_size == 96 and cfg.max_position_embeddings == 256
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings is False
    assert model.get_input_embeddings().weight.shape == (96, 32)
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 32)
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (64, 32)
    assert model.dtype == torch.float32
    # bos/eos come from the tokenizer config; the tokenizer files were copied
    assert cfg.bos_token_id == 0 and cfg.eos_token_id == 0 and cfg.pad_token_id == 1
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tiny_model_dir / name).is_file()
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    assert raw["rope_parameters"]["rope_theta"] == 10000.0 or raw.get("rope_theta") == 10000.0
    assert list(tiny_model_dir.glob("*.safetensors"))


def test_deterministic_weights(tmp_path: Path) -> None:
    spec = BenchModelSpec(16, 1, 2, 1, 32, vocab_size=40, max_position_embeddings=64)
    digests = []
    for sub in ("a", "b"):
        out = make_bench_model(spec, tmp_path / sub, copy_tokenizer=False)
        data = b"".join(p.read_bytes() for p in sorted(out.glob("*.safetensors")))
        digests.append(hashlib.sha256(data).hexdigest())
    assert digests[0] == digests[1]


def test_model_vocab(tiny_model_dir: Path) -> None:
    vocab, special = model_vocab(tiny_model_dir)
    assert vocab == 62  # the tokenizer's 62 tokens, below the model's 96 rows
    assert special == [0, 1]


def test_errors(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        make_bench_model(BenchModelSpec(16, 1, 2, 1, 32, vocab_size=96), tmp_path / "x", tmp_path)
    with pytest.raises(ValueError, match="unknown bench model"):
        make_bench_model("bench-1t", tmp_path / "y", tiny_tokenizer_dir)
    with pytest.raises(ValueError, match="vocab_size"):
        make_bench_model(BenchModelSpec(16, 1, 2, 1, 32, vocab_size=10), tmp_path / "z", tiny_tokenizer_dir)

"""Bench models written straight as compressed-tensors checkpoints (``kvserve bench
make-model NAME --format ct-w8a8|ct-w4a16``): the form llmcompressor saves and vLLM's CPU
build loads, at sizes whose float32 copy would not fit; and, written the same way, as a
plain bfloat16 checkpoint (``--format hf-bf16``, every weight in bfloat16).

Each linear weight is drawn (normal, std 0.02) in float32 one tensor at a time, quantized
as compressed-tensors stores its schemes, and written to its layer's safetensors shard;
what the schemes leave alone (the token embedding, the head: ``ignore: [lm_head]``) is
bfloat16, the norms ones. ``config.json`` carries the ``quantization_config`` llmcompressor
writes for the scheme:

- W8A8 (``int-quantized``): int8 weights, one scale an output channel (max |w| / 127.5,
  codes -128..127); activations rounded to int8 per token when the model runs.
- W4A16 (``pack-quantized``): 4-bit weights in groups of 128 columns, symmetric (max |w|
  / 7.5, codes -8..7), eight codes (plus 8) to an int32, lowest bits first.

The weights are random: the checkpoints are for speed, not for text.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from kvserve.bench.workloads.gguf_models import INIT_STD, _bfloat16_random
from kvserve.bench.workloads.models import TOKENIZER_FILES, BenchModelSpec, _hf_config, \
    _special_ids_from_tokenizer_dir

CT_FORMATS = ("ct-w8a8", "ct-w4a16")
SAFETENSORS_FORMATS = ("hf-bf16", *CT_FORMATS)  # what make_compressed_bench_model writes
GROUP_SIZE = 128
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _scheme(fmt: str) -> tuple[str, dict, dict | None]:
    """(format, weights, input activations) of a make-model format's config group."""
    common = {"actorder": None, "block_structure": None, "dynamic": False, "observer":
              "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": None,
              "symmetric": True, "type": "int", "zp_dtype": None}
    if fmt == "ct-w8a8":
        tokens = {**common, "dynamic": True, "group_size": None, "num_bits": 8,
                  "observer": None, "strategy": "token"}
        return "int-quantized", {**common, "group_size": None, "num_bits": 8,
                                 "strategy": "channel"}, tokens
    return "pack-quantized", {**common, "group_size": GROUP_SIZE, "num_bits": 4,
                              "strategy": "group"}, None


def quantization_config(fmt: str) -> dict:
    """The ``quantization_config`` of a checkpoint in ``fmt`` (CT_FORMATS)."""
    if fmt not in CT_FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r}: one of {', '.join(CT_FORMATS)}")
    form, weights, inputs = _scheme(fmt)
    return {"config_groups": {"group_0": {
                "format": form, "input_activations": inputs, "output_activations": None,
                "targets": ["Linear"], "weights": weights}},
            "format": form, "global_compression_ratio": None, "ignore": ["lm_head"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}}


def int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, float32 scales [rows, 1]) of ``w`` [rows, cols], a scale a row."""
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.5).clamp_min(1e-12)
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale


def int4_group_packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 [rows, cols / 8] of packed codes, float32 scales [rows, cols / GROUP_SIZE])
    of ``w`` [rows, cols] in symmetric groups of GROUP_SIZE columns."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    scale = (groups.abs().amax(dim=2, keepdim=True) / 7.5).clamp_min(1e-12)
    codes = torch.round(groups / scale).clamp(-8, 7).to(torch.int32).reshape(rows, cols) + 8
    nibbles = codes.reshape(rows, cols // 8, 8)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i in range(8):
        packed |= nibbles[:, :, i].to(torch.int64) << (4 * i)
    # the words' bit patterns as signed 32-bit integers, as the format stores them
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed, scale.reshape(rows, -1)


def _linear_shapes(spec: BenchModelSpec) -> dict[str, tuple[int, int]]:
    head_dim = spec.hidden_size // spec.num_heads
    q, kv, h, ff = spec.num_heads * head_dim, spec.num_kv_heads * head_dim, \
        spec.hidden_size, spec.intermediate_size
    return dict(zip(_LINEARS, ((q, h), (kv, h), (kv, h), (h, q), (ff, h), (ff, h), (h, ff))))


def _quantized(fmt: str, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    if fmt == "hf-bf16":
        return {f"{name}.weight": w.to(torch.bfloat16)}
    if fmt == "ct-w8a8":
        codes, scale = int8_channel(w)
        return {f"{name}.weight": codes, f"{name}.weight_scale": scale.to(torch.bfloat16)}
    packed, scale = int4_group_packed(w)
    return {f"{name}.weight_packed": packed, f"{name}.weight_scale": scale.to(torch.bfloat16),
            f"{name}.weight_shape": torch.tensor(w.shape, dtype=torch.int64)}


def _bfloat16(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.from_numpy(_bfloat16_random(shape, seed).view(np.int16)).view(torch.bfloat16)


def make_compressed_bench_model(spec: BenchModelSpec, name: str, fmt: str, out: Path,
                                tokenizer_dir: Path, seed: int = 0, progress: bool = True
                                ) -> Path:
    """The bench model ``spec`` as a compressed-tensors checkpoint in ``out`` (``fmt`` one
    of CT_FORMATS), or as a bfloat16 one (hf-bf16)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    config_quant = None if fmt == "hf-bf16" else quantization_config(fmt)
    if spec.architecture != "llama":
        raise ValueError(f"compressed-tensors bench models are Llamas; {name} is "
                         f"{spec.architecture}")
    if spec.hidden_size % GROUP_SIZE or spec.intermediate_size % GROUP_SIZE:
        raise ValueError(f"{name}: its widths are not whole groups of {GROUP_SIZE}")
    tokenizer_dir = Path(tokenizer_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _hf_config(spec, _special_ids_from_tokenizer_dir(tokenizer_dir)).to_dict()
    config.update(architectures=["LlamaForCausalLM"], dtype="bfloat16")
    if config_quant is not None:
        config.update(quantization_config=config_quant)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)
    shapes = _linear_shapes(spec)
    weight_map: dict[str, str] = {}
    total = 0
    shards = [f"model-{i:05d}.safetensors" for i in range(spec.num_layers + 1)]
    for index in tqdm(range(spec.num_layers + 1), desc=f"writing {out.name}", unit="shard",
                      disable=not progress):
        tensors: dict[str, torch.Tensor] = {}
        if index == spec.num_layers:  # the embedding, the head, the last norm
            vocab = (spec.vocab_size, spec.hidden_size)
            tensors["model.embed_tokens.weight"] = _bfloat16(vocab, seed * 100_003 + 1)
            if not spec.tied_embeddings:
                tensors["lm_head.weight"] = _bfloat16(vocab, seed * 100_003 + 2)
            tensors["model.norm.weight"] = torch.ones(spec.hidden_size, dtype=torch.bfloat16)
        else:
            prefix = f"model.layers.{index}"
            for norm in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"{prefix}.{norm}.weight"] = torch.ones(spec.hidden_size,
                                                                dtype=torch.bfloat16)
            for linear, shape in shapes.items():
                w = torch.randn(shape, generator=gen) * INIT_STD
                tensors.update(_quantized(fmt, f"{prefix}.{linear}", w))
        save_file(tensors, str(out / shards[index]), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, shards[index]))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for fname in TOKENIZER_FILES:
        if (tokenizer_dir / fname).is_file():
            shutil.copyfile(tokenizer_dir / fname, out / fname)
    (out / "bench_model.json").write_text(json.dumps({"name": name, "format": fmt,
                                                      **asdict(spec)}, indent=2))
    return out

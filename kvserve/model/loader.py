"""Load a Hugging Face checkpoint directory: config, safetensors weights, dtype.

Safetensors only: a checkpoint that ships just pickled ``*.bin`` weights is refused,
because unpickling runs arbitrary code.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from kvserve.model.config import ArchConfig
from kvserve.model.gguf import GGUF_MARKER, gguf_weights
from kvserve.model.quantization import quantize_model
from kvserve.model.registry import MODELS

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 in hardware (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(requested: str, model_config: ArchConfig, device: str = "cpu"
                  ) -> torch.dtype:
    """``auto``: on a GPU, float16 for a float16 checkpoint and bfloat16 for any other;
    on the CPU, the checkpoint's dtype if this CPU runs it fast, else float32."""
    if requested != "auto":
        return _DTYPES[requested]
    wanted = _DTYPES.get(model_config.torch_dtype.replace("torch.", ""), torch.float32)
    if device == "cuda":
        return torch.float16 if wanted == torch.float16 else torch.bfloat16
    if wanted in (torch.bfloat16, torch.float16) and not cpu_has_bf16():
        logger.info("checkpoint dtype %s has no hardware support on this CPU: using float32",
                    model_config.torch_dtype)
        return torch.float32
    return wanted


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if others:
        return [model_dir / p for p in others]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ValueError(
            f"{model_dir} has only pickled weights (*.bin/*.pt); kvserve loads safetensors only "
            "(convert with transformers: save_pretrained(..., safe_serialization=True))")
    raise FileNotFoundError(
        f"{model_dir} has no model.safetensors, no model.safetensors.index.json and no "
        "*.safetensors shards")


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor, Path]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name), path


def load_model(model_dir: str | Path, model_config: ArchConfig, dtype: torch.dtype,
                quantization: str | None = None, tp=None,
                device: torch.device | str = "cpu") -> nn.Module:
    """The checkpoint's model in ``dtype``, its linear layers quantized if asked; with
    ``tp`` (a TensorParallelGroup), this rank's share of it; its weights read straight
    into ``device``'s memory."""
    model_dir = Path(model_dir)
    cls = MODELS[model_config.architecture]
    with torch.device("meta"):
        model = cls(model_config)
    model = model.to_empty(device=device)
    _load_weights(model, gguf_weights(model_dir) if (model_dir / GGUF_MARKER).is_file()
                  else iter_weights(weight_files(model_dir)))
    if hasattr(model, "make_rotaries"):  # buffers are not in checkpoints: made for real
        model.make_rotaries()
    if hasattr(model, "after_load"):  # what the model computes once from its weights
        model.after_load()
    if model_config.tie_word_embeddings:
        _tie(model)
    model = model.to(dtype).to(device)  # (the tables made anew above are made on the CPU)
    if tp is not None:
        from kvserve.model.tensor_parallel import shard_model
        shard_model(model, tp)
    if quantization is not None:
        quantize_model(model, quantization)
    model.eval()
    return model


def _tie(model: nn.Module) -> None:
    emb = model.get_submodule("model.embed_tokens" if hasattr(model, "model")
                              else "transformer.wte")
    model.lm_head.weight = emb.weight


def _load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor, object]]
                  ) -> None:
    """Copy (name, tensor, where it came from) into the model's parameters."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    rename = getattr(model, "checkpoint_name", lambda n: n)
    for raw_name, tensor, path in weights:
        name = rename(raw_name)
        if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue  # buffers some checkpoints carry
        target, shard = checkpoint_target(model, name)
        if target not in params:
            raise ValueError(
                f"{Path(path).name}: tensor {raw_name!r} has no place in {type(model).__name__}")
        if any(name.endswith(s) for s in model.transposed_params):
            tensor = tensor.t()
        param = params[target]
        dest = param.data
        if shard is not None:
            sizes = model.shard_sizes(target)
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{Path(path).name}: tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded.add(target if shard is None else f"{target}#{shard}")
    _check_complete(model, params, loaded)


def checkpoint_target(model: nn.Module, name: str) -> tuple[str, int | None]:
    """The model's parameter a checkpoint tensor ``name`` (already renamed) loads into,
    and its shard there: q/k/v and gate/up go into the fused weights."""
    for frag, (fused, idx) in model.stacked_params.items():
        if frag in name:
            return name.replace(frag, fused), idx
    return name, None


def _check_complete(model: nn.Module, params: dict, loaded: set[str]) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            shards = len(model.shard_sizes(name))
            if any(f"{name}#{i}" not in loaded for i in range(shards)) and name not in loaded:
                missing.append(name)
        elif name not in loaded:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

"""A PEFT LoRA adapter directory read onto the engine's layers.

PEFT saves ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``use_rslora``,
``rank_pattern``/``alpha_pattern``) and ``adapter_model.safetensors``, whose tensors are
``base_model.model.<module>.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]). A module is named as in the checkpoint (``q_proj``); the engine fuses
q/k/v and gate/up into one layer each, so an adapter's modules land on a layer's
output slices: its q_proj on qkv_proj's first slice, and so on. PEFT computes
``base(x) + B(A(x)) * scaling``; the scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with
rsLoRA) is folded into B here.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvserve.model.layers import Linear
from kvserve.model.loader import checkpoint_target

_PREFIX = "base_model.model."
# not adapted: the LM head, MoE routers and experts (their weights are not Linear
# layers of their own here)
_NOT_ADAPTED = (".experts.", ".shared_expert", "lm_head")


@dataclass
class AdaptedLayer:
    """One engine layer's share of an adapter: output slice -> (A [r, in], B [out, r]
    with the scaling folded in)."""

    slices: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class LoRAAdapter:
    name: str
    rank: int                          # the largest rank of any of its modules
    layers: dict[str, AdaptedLayer]    # engine layer name -> its weights

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers.values()
                   for pair in layer.slices.values() for t in pair)


def lora_layers(model: nn.Module) -> dict[str, list[int]]:
    """The layers an adapter may adapt: engine layer name -> the sizes of its output
    slices (one per checkpoint module fused into it)."""
    fused = {target.strip("."): None for target, _ in model.stacked_params.values()}
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or any(x in f".{name}" for x in _NOT_ADAPTED):
            continue
        if name.endswith(".gate") or name.endswith("_gate"):  # routers
            continue
        if name.rsplit(".", 1)[-1] in fused:
            out[name] = list(model.shard_sizes(f"{name}.weight"))
        else:
            out[name] = [module.out_features]
    return out


def _pattern_value(module: str, patterns: dict, default):
    """PEFT's per-module override: the first pattern matching the module name's end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_config(path: Path) -> dict:
    config_path = path / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter {path}: no adapter_config.json (a PEFT adapter "
                         "directory, as save_pretrained writes it, is expected)")
    config = json.loads(config_path.read_text())
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {kind!r} is not supported; "
                         "supported: LORA")
    unsupported = [(key, config.get(key)) for key, off in
                   (("use_dora", False), ("bias", "none"), ("modules_to_save", None))
                   if config.get(key) not in (off, None, [])]
    if unsupported:
        raise ValueError(f"LoRA adapter {path}: {', '.join(f'{k}={v!r}' for k, v in unsupported)}"
                         " is not supported (plain LoRA: no DoRA, no bias, no modules_to_save)")
    return config


def load_adapter(name: str, path: str | Path, model: nn.Module, max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """The adapter at ``path`` onto ``model``'s layers (the model may be on the meta
    device: only names and shapes are read of it), in ``dtype``. Raises ValueError naming
    what does not fit: a module the engine does not adapt, a shape the base model does
    not have, a rank above ``max_rank``."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a directory")
    config = read_adapter_config(path)
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"LoRA adapter {path}: no adapter_model.safetensors (kvserve loads "
                         "safetensors only)")
    targets = lora_layers(model)
    rename = getattr(model, "checkpoint_name", lambda n: n)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
            if match is None:
                raise ValueError(f"LoRA adapter {path}: tensor {key!r} is not a LoRA A or B "
                                 "weight (embedding and bias adapters are not supported)")
            module = match.group(1).removeprefix(_PREFIX)
            pairs.setdefault(module, {})[match.group(2)] = f.get_tensor(key)
    layers: dict[str, AdaptedLayer] = {}
    top_rank = 0
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path}: module {module} has lora_{''.join(pair)} "
                             "but not both A and B")
        target, shard = checkpoint_target(model, rename(module) + ".weight")
        layer_name = target.removesuffix(".weight")
        if layer_name not in targets:
            raise ValueError(
                f"LoRA adapter {path}: module {module} has no LoRA-capable layer in "
                f"{type(model).__name__}; adapted are the attention and MLP projections "
                "(q/k/v/o, gate/up/down), not embeddings, the LM head or MoE experts")
        sizes = targets[layer_name]
        # a checkpoint module of one slice, or (shard None) of the whole layer: a fused
        # checkpoint's qkv_proj, whose B splits over the slices, each with the same A
        indices = [shard] if shard is not None else list(range(len(sizes)))
        outputs = sum(sizes[i] for i in indices)
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        layer = model.get_submodule(layer_name)
        if (a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank
                or a.shape[1] != layer.in_features or b.shape[0] != outputs):
            raise ValueError(
                f"LoRA adapter {path}: module {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; the base model's layer takes {layer.in_features} inputs "
                f"and gives {outputs} outputs (an adapter of another base model?)")
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {path}: rank {rank} (module {module}) exceeds "
                             f"max_lora_rank {max_rank}; raise --max-lora-rank")
        alpha = _pattern_value(module, config.get("alpha_pattern") or {},
                               config.get("lora_alpha", 8))
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        scaled = (b.float() * scaling).to(dtype)
        first = 0
        for index in indices:
            layers.setdefault(layer_name, AdaptedLayer()).slices[index] = (
                a.to(dtype).contiguous(), scaled[first:first + sizes[index]].contiguous())
            first += sizes[index]
        top_rank = max(top_rank, rank)
    if not layers:
        raise ValueError(f"LoRA adapter {path}: no LoRA weights in adapter_model.safetensors")
    return LoRAAdapter(name, top_rank, layers)

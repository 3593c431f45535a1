"""A quantized checkpoint's ``quantization_config``: which linear layers are quantized,
and how (the schemes kvserve computes, as vLLM's CPU build loads them). compressed-tensors
(as llmcompressor saves it):

- ``w8a8``: ``int-quantized``, int8 weights with one scale per output channel, symmetric;
  int8 activations rounded per token at run time (``dynamic``, symmetric).
- ``w4a16``: ``pack-quantized``, 4-bit weights in groups of ``group`` input columns (or
  one group a row: ``channel``), symmetric or asymmetric, activations in float; groups of
  consecutive columns (``actorder`` ``static`` or ``weight``, as llmcompressor's GPTQ
  writes them; ``group``, whose ``weight_g_idx`` scatters a group's columns, is refused).

GPTQ (``quant_method`` ``gptq``, as GPTQModel saves it) and AWQ (``awq``, AutoAWQ's
``gemm`` layout): 4-bit ``w4a16`` on every linear layer of the decoder blocks, grouped or
one group a row; GPTQ symmetric or not, its ``desc_act`` (act-order) groups gathered by
permuting the input columns (``Scheme.act_order``); AWQ with or without zero points (its
``qzeros`` read either way).

Anything else is refused, naming what is.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = "compressed-tensors int-quantized W8A8 (int8 channel weights, dynamic per-token " \
            "int8 activations) and pack-quantized W4A16 (4-bit grouped or channel weights); " \
            "GPTQ 4-bit (gptq or gptq_v2 format, with or without desc_act); AWQ 4-bit (gemm " \
            "version)"


@dataclass(frozen=True)
class Scheme:
    kind: str  # "w8a8" or "w4a16"
    group: int | None = None  # w4a16: columns a scale covers (None: the whole row)
    symmetric: bool = True
    act_order: bool = False  # w4a16: groups gathered by g_idx from anywhere in the row


@dataclass(frozen=True)
class CompressedConfig:
    groups: tuple[tuple[tuple[str, ...], Scheme], ...]  # (targets, scheme)
    ignore: tuple[str, ...]
    format: str = "compressed-tensors"  # or "gptq", "awq"
    zeros_stored_minus_one: bool = False  # GPTQ's first format keeps each zero point - 1

    @property
    def marker(self) -> str:
        """The tensor a quantized layer has and a float one does not."""
        return "weight_scale" if self.format == "compressed-tensors" else "qweight"

    def scheme_for(self, module: str) -> Scheme | None:
        """The scheme of the linear layer the checkpoint names ``module`` (None: float)."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, module) for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        kinds = sorted({s.kind for _, s in self.groups})
        name = {"gptq": "GPTQ", "awq": "AWQ"}.get(self.format, self.format)
        return name + " " + "/".join(k.upper() for k in kinds)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def read_compressed_config(model_dir: str | Path) -> CompressedConfig | None:
    """The checkpoint's compressed-tensors config (None: the checkpoint is not quantized).
    A quantization_config kvserve does not compute is refused."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text()).get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method")
    if method in ("gptq", "awq"):
        try:
            return (_gptq_config if method == "gptq" else _awq_config)(config)
        except ValueError as e:
            raise ValueError(f"{model_dir}: {method} quantization_config: {e}; supported: "
                             f"{SUPPORTED}") from None
    if method != "compressed-tensors":
        raise ValueError(f"{model_dir}: quantization_config quant_method {method!r} is not "
                         f"supported; supported: {SUPPORTED}")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{model_dir}: quantization_status {status!r}: only compressed "
                         "checkpoints (as llmcompressor saves them) are supported")
    for extra in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if config.get(extra):
            raise ValueError(f"{model_dir}: quantization_config has a {extra}, which is not "
                             f"supported; supported: {SUPPORTED}")
    groups = []
    for name, group in config.get("config_groups", {}).items():
        fmt = group.get("format") or config.get("format")
        try:
            scheme = _scheme(fmt, group.get("weights") or {}, group.get("input_activations"))
        except ValueError as e:
            raise ValueError(f"{model_dir}: config group {name!r}: {e}; supported: "
                             f"{SUPPORTED}") from None
        groups.append((tuple(group.get("targets", ())), scheme))
    if not groups:
        raise ValueError(f"{model_dir}: quantization_config has no config_groups")
    return CompressedConfig(tuple(groups), tuple(config.get("ignore") or ()))


def _scheme(fmt: str | None, weights: dict, inputs: dict | None) -> Scheme:
    if weights.get("type", "int") != "int":
        raise ValueError(f"weights of type {weights.get('type')!r}")
    if weights.get("block_structure") is not None:
        raise ValueError(f"block-structured weights ({weights['block_structure']})")
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    if fmt == "int-quantized":
        if bits != 8 or strategy != "channel" or not weights.get("symmetric", True):
            raise ValueError(f"int-quantized weights of {bits} bits, {strategy} strategy, "
                             f"symmetric={weights.get('symmetric')}")
        if not inputs or inputs.get("num_bits") != 8 or not inputs.get("dynamic") \
                or inputs.get("strategy") != "token" or not inputs.get("symmetric", True):
            raise ValueError(f"int-quantized input activations {inputs}")
        return Scheme("w8a8")
    if fmt == "pack-quantized":
        if bits != 4 or inputs:
            raise ValueError(f"pack-quantized weights of {bits} bits with input activations "
                             f"{inputs}")
        if strategy == "group":
            group = int(weights["group_size"])
            if group % 32:
                raise ValueError(f"group_size {group} is not a multiple of 32")
        elif strategy == "channel":
            group = None
        else:
            raise ValueError(f"pack-quantized {strategy} strategy")
        order = weights.get("actorder")
        if order not in (None, "static", "weight"):
            raise ValueError(f"actorder {order!r} (its groups are not consecutive columns)")
        return Scheme("w4a16", group, bool(weights.get("symmetric", True)))
    raise ValueError(f"format {fmt!r}")


def _four_bit_groups(config: dict) -> int | None:
    bits, group = config.get("bits", config.get("w_bit")), config.get("group_size",
                                                                      config.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"bits {bits} (4 is computed)")
    if group in (None, -1):
        return None
    if int(group) % 32:
        raise ValueError(f"group_size {group} is not a multiple of 32")
    return int(group)


def _gptq_config(config: dict) -> CompressedConfig:
    group = _four_bit_groups(config)
    fmt = config.get("checkpoint_format", config.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format {fmt!r} (gptq and gptq_v2 are read)")
    for extra in ("dynamic", "lm_head"):
        if config.get(extra):
            raise ValueError(f"{extra} {config[extra]!r} (every decoder linear layer "
                             "quantized alike, the LM head in float)")
    if config.get("pack_dtype", "int32") != "int32":
        raise ValueError(f"pack_dtype {config['pack_dtype']!r} (int32 words are read)")
    scheme = Scheme("w4a16", group, bool(config.get("sym", True)),
                    act_order=bool(config.get("desc_act", False)))
    return CompressedConfig(((("Linear",), scheme),), ("lm_head",), "gptq",
                            zeros_stored_minus_one=fmt == "gptq")


def _awq_config(config: dict) -> CompressedConfig:
    group = _four_bit_groups(config)
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"version {version!r} (gemm's layout is read)")
    # AutoAWQ leaves a layer in float when its name contains any of these
    ignore = ("lm_head", *(f"re:.*{re.escape(key)}" for key in
                           config.get("modules_to_not_convert") or ()))
    scheme = Scheme("w4a16", group, not config.get("zero_point", True))
    return CompressedConfig(((("Linear",), scheme),), ignore, "awq")



def stored_format(model_dir: str | Path) -> str | None:
    """How a compressed-tensors checkpoint's layers are stored (what its kernels' speed
    depends on beyond the model's shape); None for any other checkpoint."""
    config = read_compressed_config(model_dir)
    return None if config is None else f"{config.describe()} {[s for _, s in config.groups]}"

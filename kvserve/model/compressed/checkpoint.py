"""A quantized checkpoint's layers, read into the kernels' layouts.

Each quantized layer's tensors (``weight`` + ``weight_scale`` for W8A8; ``weight_packed``,
``weight_scale``, ``weight_shape``, and ``weight_zero_point`` where the scheme has one,
for W4A16) are gathered and yielded as one value under the layer's
``.weight`` name: an :class:`Int8Weight`, or an :class:`Int4Weight` with the codes
unpacked from int32 words (eight 4-bit values a word, the first in the low bits, each
stored plus 8) and repacked for the kernel, the zero points likewise (packed eight
output rows a word). GPTQ and AWQ layers (``qweight``, ``qzeros``, ``scales`` and GPTQ's
``g_idx``) are read by :mod:`kvserve.model.compressed.gptq_awq`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from kvserve.model.compressed.gptq_awq import PARTS, awq_weight, gptq_weight
from kvserve.model.compressed.linear import Int4Weight, pack_codes, unpack_words
from kvserve.model.compressed.scheme import CompressedConfig, Scheme

_OFFSET = 8  # a signed 4-bit value v is stored as the code v + 8


@dataclass
class Int8Weight:
    """A W8A8 weight: int8 values [out, in] and one float32 scale an output row."""
    qweight: torch.Tensor
    scale: torch.Tensor

    @property
    def rows(self) -> int:
        return self.qweight.shape[0]


def _required(config: CompressedConfig, scheme: Scheme) -> set[str]:
    if config.format != "compressed-tensors":
        return PARTS[config.format]
    if scheme.kind == "w8a8":
        return {"weight", "weight_scale"}
    needed = {"weight_packed", "weight_scale", "weight_shape"}
    if not scheme.symmetric:
        needed.add("weight_zero_point")
    return needed


def _int4_weight(module: str, scheme: Scheme, parts: dict[str, torch.Tensor]) -> Int4Weight:
    rows, cols = (int(n) for n in parts["weight_shape"].tolist())
    codes = unpack_words(parts["weight_packed"])[:, :cols]
    scales = parts["weight_scale"].float().reshape(rows, -1).contiguous()
    groups = scales.shape[1]
    if codes.shape[0] != rows or cols % groups:
        raise ValueError(f"{module}: weight_packed {tuple(parts['weight_packed'].shape)} and "
                         f"weight_scale {tuple(scales.shape)} do not make [{rows}, {cols}]")
    if scheme.symmetric:
        zeros = torch.full((rows, groups), _OFFSET, dtype=torch.int8)
    else:
        zp = parts["weight_zero_point"]
        if zp.shape[0] == rows:  # not packed: the signed values
            zeros = (zp.to(torch.int32) + _OFFSET).to(torch.int8)
        else:  # packed eight output rows a word, down the columns
            zeros = unpack_words(zp.to(torch.int32).t().contiguous())[:, :rows].t()
            zeros = zeros.to(torch.int8).contiguous()
        if zeros.shape != (rows, groups):
            raise ValueError(f"{module}: weight_zero_point {tuple(zp.shape)} does not give "
                             f"a zero a group ({rows}, {groups})")
    return Int4Weight(pack_codes(codes), scales, zeros)


def compressed_weights(weights: Iterator[tuple[str, torch.Tensor, object]],
                       config: CompressedConfig, is_linear: Callable[[str], bool]
                       ) -> Iterator[tuple[str, torch.Tensor | Int4Weight | Int8Weight, object]]:
    """``weights`` (name, tensor, source) with each quantized linear layer's tensors
    gathered into one ``<layer>.weight`` value; other tensors pass as they are.
    ``is_linear(layer name)``: whether the model computes that layer as a linear one."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor, source in weights:
        module, _, attr = name.rpartition(".")
        scheme = config.scheme_for(module) if is_linear(module) else None
        if scheme is None or attr not in _required(config, scheme):
            yield name, tensor, source
            continue
        parts = pending.setdefault(module, {})
        parts[attr] = tensor
        if _required(config, scheme) <= parts.keys():
            del pending[module]
            if config.format == "gptq":
                value = gptq_weight(module, scheme, parts, config.zeros_stored_minus_one)
            elif config.format == "awq":
                value = awq_weight(module, scheme, parts)
            elif scheme.kind == "w8a8":
                if parts["weight"].dtype != torch.int8:
                    raise ValueError(f"{module}.weight is {parts['weight'].dtype}, not int8")
                value = Int8Weight(parts["weight"], parts["weight_scale"].float().reshape(-1))
            else:
                value = _int4_weight(module, scheme, parts)
            yield f"{module}.weight", value, source
    if pending:
        module, parts = next(iter(pending.items()))
        missing = sorted(_required(config, config.scheme_for(module)) - parts.keys())
        raise ValueError(f"checkpoint is missing {', '.join(missing)} of {module}"
                         + (f" (and parts of {len(pending) - 1} more layers)"
                            if len(pending) > 1 else ""))

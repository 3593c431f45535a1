"""A linear layer computed on 4-bit weights (compressed-tensors W4A16), its linear method.

The layer holds the weight at 4 bits a value in the native kernel's layout
(``kvserve/kernels/int4_linear.c``): ``codes`` [out, in/2] uint8, ``scales`` [out, groups]
float32 and ``zeros`` [out, groups] int8 (the code of 0: 8 for a symmetric layer); a
layer whose groups gather columns from anywhere in the row (GPTQ's act-order) has its
columns sorted by group and ``perm`` [in] int64, the input column each one multiplies.
A step of up to ``NATIVE_MAX_ROWS`` rows runs the native kernel,
which widens the codes in registers; a longer one dequantizes ``TILE_ROWS`` weight rows
at a time, exactly ``(q - z) * s``, and multiplies them with torch's GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.linear_method import LinearMethod

NATIVE_MAX_ROWS = 8
TILE_ROWS = 256
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass
class Int4Weight:
    """A W4A16 weight in the kernel's layout (see the module docstring)."""
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.codes.shape[0]


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> [..., 8n] 4-bit codes (0..15), the low bits first."""
    return ((words.to(torch.int32)[..., None] >> _SHIFTS) & 0xF).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes 0..15 -> [rows, cols/2] uint8: each run of 32 values in 16
    bytes, value i in byte i's low nibble and value i + 16 in its high one."""
    runs = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """pack_codes' inverse: [rows, cols/2] uint8 -> [rows, cols] int16."""
    runs = packed.to(torch.int16).reshape(packed.shape[0], -1, 1, 16)
    return torch.cat([runs & 0xF, runs >> 4], dim=2).reshape(packed.shape[0], -1)


def dequantize_int4(codes, scales, zeros) -> torch.Tensor:
    """float32 [rows, cols] = (q - z) * s, in torch (the path without native kernels)."""
    values = unpack_codes(codes)
    group = values.shape[1] // scales.shape[1]
    offsets = (values - zeros.to(torch.int16).repeat_interleave(group, dim=1)).float()
    return offsets * scales.float().repeat_interleave(group, dim=1)


class Int4LinearMethod(LinearMethod):
    """``group``: the input columns a scale covers."""

    def __init__(self, group: int) -> None:
        self.group = group
        self.native = None
        self.perm_loaded = False

    @classmethod
    def install(cls, layer: nn.Linear, group: int | None,
                act_order: bool = False) -> Int4LinearMethod:
        """Give ``layer`` (on the meta device, before its weights load) this method: its
        float weight is dropped, empty 4-bit buffers of its shape take its place (filled
        by ``load``); with ``act_order``, a column order as well."""
        out_f, in_f = layer.out_features, layer.in_features
        group = group or in_f
        if in_f % group or group % 32:
            raise ValueError(f"a layer of {in_f} input columns in groups of {group}: the "
                             "groups must be whole multiples of 32 that divide the columns")
        layer.register_parameter("weight", None)
        groups = in_f // group
        meta = torch.device("meta")
        layer.register_buffer("codes", torch.empty(out_f, in_f // 2, dtype=torch.uint8,
                                                   device=meta))
        layer.register_buffer("scales", torch.empty(out_f, groups, device=meta))
        layer.register_buffer("zeros", torch.empty(out_f, groups, dtype=torch.int8, device=meta))
        layer.register_buffer("perm", torch.empty(in_f, dtype=torch.int64, device=meta)
                              if act_order else None)
        layer.method = method = cls(group)
        return method

    def load(self, layer: nn.Linear, first_row: int, weight: Int4Weight) -> None:
        """Rows ``first_row`` onwards (a part of a fused layer, or all of it)."""
        rows = weight.rows
        for name in ("codes", "scales", "zeros"):
            dest, src = getattr(layer, name), getattr(weight, name)
            if src.shape[1:] != dest.shape[1:] or first_row + rows > dest.shape[0]:
                raise ValueError(f"{name} of shape {tuple(src.shape)} does not fit rows "
                                 f"{first_row}:{first_row + rows} of {tuple(dest.shape)}")
            dest[first_row:first_row + rows] = src
        self._load_perm(layer, weight.perm)

    def _load_perm(self, layer: nn.Linear, perm: torch.Tensor | None) -> None:
        if layer.perm is None:
            if perm is not None:
                raise ValueError("a weight with an act-order column order for a layer "
                                 "installed without one")
            return
        order = perm if perm is not None else torch.arange(layer.in_features)
        if not self.perm_loaded:
            layer.perm.copy_(order)
            self.perm_loaded = True
        elif not torch.equal(layer.perm.cpu(), order):
            raise ValueError("the parts of this fused layer order their input columns "
                             "differently (act-order g_idx); one order a fused layer is "
                             "supported")

    def configure(self, layer: nn.Linear, mode) -> None:
        kernels = getattr(mode, "kernels", None)
        self.native = kernels if kernels is not None and kernels.available else None
        if layer.scales.dtype != torch.float32:  # a model moved to a 16-bit dtype
            layer.scales = layer.scales.float()
        if layer.perm is not None and torch.equal(
                layer.perm.cpu(), torch.arange(layer.in_features)):
            layer.perm = None  # the columns in their own order: nothing to gather

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        x = x.float().contiguous()
        scales = layer.scales.float()
        native = self.native is not None and x.device.type == "cpu"
        out = x.new_empty((x.shape[0], layer.out_features))
        if native and x.shape[0] <= NATIVE_MAX_ROWS:
            self.native.int4_rows(x, layer.codes, scales, layer.zeros, self.group, out)
        else:
            for start in range(0, layer.out_features, TILE_ROWS):
                part = slice(start, start + TILE_ROWS)
                args = (layer.codes[part], scales[part], layer.zeros[part])
                w = (self.native.int4_dequantize(*args, self.group) if native
                     else dequantize_int4(*args))
                out[:, part] = F.linear(x, w.to(x.device))
        if layer.bias is not None:
            out += layer.bias.float()
        return out if dtype == torch.float32 else out.to(dtype)

"""GPTQ and AWQ layers read into :class:`Int4Weight` (the 4-bit kernel's layout).

Both keep 4-bit codes eight to an int32 word, the first in the low bits, and per group a
float16 scale and a 4-bit zero point (eight output rows a word), the value being
``(q - z) * s``:

- GPTQ (GPTQModel's ``gptq`` and ``gptq_v2`` formats): ``qweight`` [in/8, out] packs down
  the input columns, ``qzeros`` [groups, out/8], ``scales`` [groups, out], ``g_idx`` [in]
  each input column's group. The ``gptq`` format stores each zero point minus one. With
  act-order (``desc_act``) a group's columns lie anywhere in the row: the columns are
  sorted by group, and the layer permutes its input to match (``Int4Weight.perm``).
- AWQ (``gemm``): ``qweight`` [in, out/8] packs along the output rows in the order
  0, 2, 4, 6, 1, 3, 5, 7; ``qzeros`` [groups, out/8] the same; ``scales`` [groups, out].
"""
from __future__ import annotations

import torch

from kvserve.model.compressed.linear import Int4Weight, pack_codes, unpack_words
from kvserve.model.compressed.scheme import Scheme

PARTS = {"gptq": {"qweight", "qzeros", "scales", "g_idx"},
         "awq": {"qweight", "qzeros", "scales"}}
# AWQ's word holds output rows 8c + (0, 2, 4, 6, 1, 3, 5, 7) in its nibbles 0..7:
# row 8c + r is in nibble _AWQ_NIBBLE[r]
_AWQ_NIBBLE = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])


def _groups(module: str, scheme: Scheme, scales: torch.Tensor, cols: int) -> int:
    groups = scales.shape[0]
    expected = cols // scheme.group if scheme.group else 1
    if groups != expected:
        raise ValueError(f"{module}: scales {tuple(scales.shape)} for {cols} input columns "
                         f"in groups of {scheme.group or cols}: {expected} groups expected")
    return groups


def _checked(module: str, codes: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor) -> None:
    rows = codes.shape[0]
    if scales.shape[0] != rows or zeros.shape != scales.shape:
        raise ValueError(f"{module}: {rows} output rows in qweight, scales for "
                         f"{scales.shape[0]}, zero points for {zeros.shape[0]}")


def gptq_weight(module: str, scheme: Scheme, parts: dict[str, torch.Tensor],
                zeros_stored_minus_one: bool) -> Int4Weight:
    codes = unpack_words(parts["qweight"].t().contiguous())  # [out, in]
    cols = codes.shape[1]
    groups = _groups(module, scheme, parts["scales"], cols)
    scales = parts["scales"].float().t().contiguous()
    zeros = unpack_words(parts["qzeros"])[:, :codes.shape[0]]  # [groups, out]
    if zeros_stored_minus_one:
        zeros = (zeros + 1) & 0xF
    zeros = zeros.t().to(torch.int8).contiguous()
    _checked(module, codes, scales, zeros)
    g_idx = parts["g_idx"].to(torch.int64)
    size = cols // groups
    in_order = torch.arange(cols) // size
    if g_idx.shape != (cols,):
        raise ValueError(f"{module}: g_idx {tuple(g_idx.shape)} for {cols} input columns")
    if torch.equal(g_idx, in_order):
        return Int4Weight(pack_codes(codes), scales, zeros)
    perm = torch.argsort(g_idx, stable=True)
    if not scheme.act_order or not torch.equal(g_idx[perm], in_order):
        raise ValueError(f"{module}: g_idx puts the input columns in groups that are not "
                         f"{size} columns each" if scheme.act_order else
                         f"{module}: g_idx orders the columns, but desc_act is false")
    return Int4Weight(pack_codes(codes[:, perm]), scales, zeros, perm)


def _awq_rows(words: torch.Tensor) -> torch.Tensor:
    """AWQ's [n, out/8] words -> [n, out] codes, the output rows in order."""
    nibbles = unpack_words(words)
    return nibbles.reshape(nibbles.shape[0], -1, 8)[:, :, _AWQ_NIBBLE].flatten(1)


def awq_weight(module: str, scheme: Scheme, parts: dict[str, torch.Tensor]) -> Int4Weight:
    codes = _awq_rows(parts["qweight"]).t().contiguous()  # [out, in]
    _groups(module, scheme, parts["scales"], codes.shape[1])
    scales = parts["scales"].float().t().contiguous()
    zeros = _awq_rows(parts["qzeros"]).t().to(torch.int8).contiguous()
    _checked(module, codes, scales, zeros)
    return Int4Weight(pack_codes(codes), scales, zeros)

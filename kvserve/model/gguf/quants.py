"""The GGUF block formats, dequantized in torch (whole tensors, vectorised over blocks).

Each format stores a row as blocks of ``BLOCK`` values in ``BYTES`` bytes (llama.cpp's
``ggml-common.h`` layouts):

- ``Q8_0``: 32 values: an f16 scale ``d``, 32 int8; ``x = d * q``.
- ``Q4_0``: 32 values: ``d``, 16 bytes of 4-bit codes (low nibbles the first 16 values,
  high nibbles the last 16); ``x = d * (q - 8)``.
- ``Q4_K``: 256 values in 8 sub-blocks of 32: f16 ``d`` and ``dmin``, 12 bytes packing a
  6-bit scale and a 6-bit min per sub-block, 128 bytes of 4-bit codes (each run of 32
  bytes: low nibbles one sub-block, high nibbles the next); ``x = d*sc*q - dmin*m``.
- ``Q5_K``: as Q4_K with a fifth bit per value from 32 bytes ``qh`` (bit s of byte l for
  value l of sub-block s).
- ``Q6_K``: 256 values in 16 groups of 16: 128 bytes of low 4 bits, 64 bytes of high 2
  bits, 16 int8 scales, f16 ``d``; ``x = d * sc * (q - 32)``.
"""
from __future__ import annotations

import torch

# format -> (values a block, bytes a block)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176),
          "Q6_K": (256, 210)}
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
FORMATS = tuple(FLOATS) + tuple(BLOCKS)
# the formats whose weights are computed on as the file stores them (the rest are read
# into float32): the blocks, and the 16-bit floats
KEPT = (*BLOCKS, "BF16", "F16")
# where each format keeps its f16 scales (byte offsets in a block): random bytes there
# could spell infinities or NaNs
SCALE_HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _half(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian f16 bytes -> [n, 1] float32."""
    return raw.contiguous().view(torch.float16).float()


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    return _half(raw[:, :2]) * raw[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    qs = raw[:, 2:].int()
    return _half(raw[:, :2]) * (torch.cat([qs & 0xF, qs >> 4], dim=1) - 8).float()


def _scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K formats' 12 bytes -> each sub-block's 6-bit scale and min, [n, 8] each."""
    s = packed.int()
    low = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mins = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return low.float(), mins.float()


def _nibbles_by_subblock(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of 4-bit codes -> [n, 8, 32]: run c's low nibbles are sub-block 2c, its
    high nibbles 2c + 1."""
    runs = qs.int().view(-1, 4, 32)
    return torch.stack([runs & 0xF, runs >> 4], dim=2).view(-1, 8, 32)


def _k_dequant(raw: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    d, dmin = _half(raw[:, 0:2]), _half(raw[:, 2:4])
    sc, m = _scales_mins(raw[:, 4:16])
    return (d[:, :, None] * sc[:, :, None] * codes.float()
            - dmin[:, :, None] * m[:, :, None]).view(-1, 256)


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    return _k_dequant(raw, _nibbles_by_subblock(raw[:, 16:144]))


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    qh = raw[:, 16:48].int()  # [n, 32]
    fifth = (qh[:, None, :] >> torch.arange(8, dtype=torch.int32)[None, :, None]) & 1
    return _k_dequant(raw, _nibbles_by_subblock(raw[:, 48:176]) | (fifth << 4))


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    ql, qh = raw[:, :128].int().view(-1, 2, 64), raw[:, 128:192].int().view(-1, 2, 32)
    scales = raw[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    low = torch.stack([ql[:, :, :32] & 0xF, ql[:, :, 32:] & 0xF, ql[:, :, :32] >> 4,
                       ql[:, :, 32:] >> 4], dim=2)  # [n, 2 halves, 4 quarters, 32]
    high = torch.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=2)
    codes = ((low | (high << 4)) - 32).view(-1, 256).float()
    return _half(raw[:, 208:210]) * scales.repeat_interleave(16, dim=1) * codes


_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(raw: torch.Tensor, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of a tensor of ``shape`` stored as ``kind``: ``raw`` holds its
    bytes (uint8, any shape) or, for float formats, its values."""
    if kind in FLOATS:
        if raw.dtype == torch.uint8:  # the bytes as the file stores them
            raw = raw.contiguous().view(FLOATS[kind])
        return raw.reshape(shape).float()
    if kind not in BLOCKS:
        raise ValueError(f"GGUF tensor type {kind} is not supported; supported: "
                         f"{', '.join(FORMATS)}")
    values, nbytes = BLOCKS[kind]
    if shape[-1] % values:
        raise ValueError(f"a {kind} row of {shape[-1]} values is not whole blocks of {values}")
    blocks = raw.reshape(-1, nbytes)
    return _DEQUANT[kind](blocks).reshape(shape)


def random_blocks(kind: str, count: int, seed: int):
    """``count`` blocks of ``kind`` (numpy uint8 [count, bytes]) of random codes and
    scales, for tests and kernel benches; BF16 and F16: 32 random floats a "block", as the
    kernels take them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind in ("BF16", "F16"):
        values = torch.from_numpy(rng.standard_normal(count * 32).astype(np.float32))
        return values.to(FLOATS[kind]).view(torch.uint8).numpy().reshape(count, 64)
    nbytes = BLOCKS[kind][1]
    raw = rng.integers(0, 256, size=(count, nbytes), dtype=np.uint8)
    for at in SCALE_HALVES[kind]:
        raw[:, at:at + 2] = rng.uniform(-2, 2, count).astype(np.float16).view(np.uint8) \
            .reshape(count, 2)
    return raw

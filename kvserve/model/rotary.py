"""Rotary position embeddings: cos/sin tables by absolute position, precomputed for every
position the model takes, with the scalings checkpoints ship (``linear``, ``dynamic``,
``llama3``, ``yarn``, ``longrope``), each computed as transformers computes it."""
from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.kernels import NATIVE_ELEMENTWISE_DTYPES
from kvserve.model.config import RopeConfig
from kvserve.model.execution import ExecutionMode


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between
    (by the rotations ``beta_fast``/``beta_slow`` make over the original length)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))
    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) \
        + (1.0 / pos_freqs) * extrapolation
    factor = rope.attention_factor
    if factor is None:
        factor = (_yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor,
                                                                        rope.mscale_all_dim)
                  if rope.mscale and rope.mscale_all_dim else _yarn_mscale(rope.factor))
    return inv_freq, float(factor)


def _longrope_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))


def _dynamic_freqs(rope: RopeConfig, dim: int, positions: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: a token at position p past the trained length rotates with the base
    transformers computes for a sequence of p + 1 tokens, the length it has when that
    token is generated; within the trained length, the plain base."""
    trained = rope.original_max_position_embeddings
    lengths = torch.maximum(positions[:, 0].to(torch.int64) + 1, torch.tensor(trained))
    base = rope.theta * ((rope.factor * lengths / trained) - (rope.factor - 1)) ** (
        dim / (dim - 2))
    inv_freq = 1.0 / (base[:, None] ** _exponents(dim)[None, :])
    within = positions < trained
    plain = positions * (1.0 / (rope.theta ** _exponents(dim)))[None, :]
    return torch.where(within, plain, positions * inv_freq)


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """The inverse frequencies of a rope without per-position choices (all but
    longrope)."""
    inv_freq = 1.0 / (rope.theta ** _exponents(dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq)
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)[0]
    return inv_freq


def rope_tables(rope: RopeConfig, dim: int, max_positions: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, dim] (rotate-half layout). longrope takes its short
    factors at positions within the original length and its long ones beyond it, and
    dynamic rescales each position past it by its own length: a prompt within the
    original length matches transformers exactly, however far generation goes past it;
    transformers rotates a whole longer prompt by the prompt's length."""
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
    scale = 1.0
    if rope.rope_type == "longrope":
        exps = _exponents(dim)
        short = 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * rope.theta ** exps)
        long = 1.0 / (torch.tensor(rope.long_factor, dtype=torch.float32) * rope.theta ** exps)
        within = positions < rope.original_max_position_embeddings
        freqs = torch.where(within, positions * short[None, :], positions * long[None, :])
        scale = _longrope_factor(rope)
    elif rope.rope_type == "dynamic":
        freqs = _dynamic_freqs(rope, dim, positions)
    else:
        freqs = positions * rope_inv_freq(rope, dim)[None, :]
        if rope.rope_type == "yarn":
            scale = _yarn(rope, dim)[1]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables of ``dim`` (the head's, or its rotated part's), indexed
    by absolute position."""

    native = None  # kvserve.kernels.Kernels when configured to use them

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int) -> None:
        super().__init__()
        if torch.empty(0).is_meta:  # a model built on the meta device: shapes only (the
            # loader makes the tables for real; torch's meta arange would import its compiler)
            cos = sin = torch.empty(max_positions, dim)
        else:
            cos, sin = rope_tables(rope, dim, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def configure(self, mode: ExecutionMode) -> None:
        self.native = mode.kernels if self.cos.dtype in NATIVE_ELEMENTWISE_DTYPES else None

    def rotate_qkv_(self, positions: torch.Tensor, qkv: torch.Tensor, num_q: int,
                    num_k: int, head_dim: int) -> bool:
        """Rotate q and k inside a fused [T, q|k|v] activation in place, when the native
        kernel can; False means nothing was done (use ``forward`` on the split q, k)."""
        if (self.native is None or qkv.dtype != self.cos.dtype or qkv.stride(1) != 1
                or positions.dtype != torch.int64 or not positions.is_contiguous()
                or self.cos.shape[1] != head_dim):
            return False
        self.native.rotary_(qkv, positions, self.cos, self.sin, num_q, num_k, head_dim)
        return True

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, d]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        dim = cos.shape[-1]
        if dim == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        # partial rotary: the first ``dim`` of each head rotate, the rest pass through
        return tuple(torch.cat((x[..., :dim] * cos + _rotate_half(x[..., :dim]) * sin,
                                x[..., dim:]), dim=-1) for x in (q, k))


    def rotate_back(self, offsets: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, d], rotated at some positions, rotated back by ``offsets`` [T]
        positions (the rotation by -offset; offset 0 leaves x as it is)."""
        cos = self.cos[offsets].unsqueeze(1).to(x.dtype)
        sin = self.sin[offsets].unsqueeze(1).to(x.dtype)
        return x * cos - _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

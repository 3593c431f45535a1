"""Small building blocks shared by the model families."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import NATIVE_ELEMENTWISE_DTYPES
from kvserve.model.config import RopeConfig
from kvserve.model.execution import ExecutionMode
from kvserve.model.linear_method import FloatLinearMethod, LinearMethod


class Linear(nn.Linear):
    """nn.Linear whose computation is its ``method``'s (kvserve.model.linear_method): a
    float weight's layouts and paths unless the model is quantized. Rows are
    independent, so every method takes them flat."""

    step_part = "linear"  # for the step profiler (kvserve/worker/step_profiler.py)

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.method: LinearMethod = FloatLinearMethod()

    def configure(self, mode: ExecutionMode) -> None:
        self.method.configure(self, mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            flat = self(x.reshape(-1, x.shape[-1]))
            return flat.reshape(*x.shape[:-1], self.out_features)
        if x.shape[0] == 0:  # a step with no rows here (none to sample, say)
            return x.new_empty((0, self.out_features))
        return self.method.apply(self, x)


# glibc serves allocations of 32 MiB and more (its largest mmap threshold) with fresh
# pages from the kernel at every call; keeping each MLP intermediate under half that
# lets the heap reuse it, with no page faults inside a step.
MAX_INTERMEDIATE_BYTES = 16 * 2**20


def in_row_chunks(fn, x: torch.Tensor, row_elements: int) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn``, run on row chunks whose largest intermediate
    (``row_elements`` per row, counted at 4 bytes: float32, or an int8 layer's int32
    sums) stays under MAX_INTERMEDIATE_BYTES; a row larger than that runs alone."""
    rows = max(1, MAX_INTERMEDIATE_BYTES // (4 * row_elements))
    if x.shape[0] <= rows:
        return fn(x)
    return torch.cat([fn(chunk) for chunk in x.split(rows)])


class RMSNorm(nn.Module):
    native = None  # kvserve.kernels.Kernels when configured to use them

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def configure(self, mode: ExecutionMode) -> None:
        ok = self.weight.dtype in NATIVE_ELEMENTWISE_DTYPES
        self.native = mode.kernels if ok else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with ``residual``: residual + x (written into ``residual``) and its
        RMSNorm, returned as (normed, sum) — the residual add fused into the norm."""
        native = (self.native is not None and x.dim() == 2 and x.dtype == self.weight.dtype)
        if residual is None:
            if native:
                return self.native.rms_norm(x.contiguous(), self.weight, self.eps)
            return self._norm(x)
        if native and residual.dtype == x.dtype and residual.is_contiguous():
            return self.native.add_rms_norm(x.contiguous(), residual, self.weight,
                                            self.eps), residual
        residual = residual.add_(x)
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                     / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
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
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, indexed by absolute position (rotate-half layout)."""

    native = None  # kvserve.kernels.Kernels when configured to use them

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def configure(self, mode: ExecutionMode) -> None:
        self.native = mode.kernels if self.cos.dtype in NATIVE_ELEMENTWISE_DTYPES else None

    def rotate_qkv_(self, positions: torch.Tensor, qkv: torch.Tensor, num_q: int,
                    num_k: int, head_dim: int) -> bool:
        """Rotate q and k inside a fused [T, q|k|v] activation in place, when the native
        kernel can; False means nothing was done (use ``forward`` on the split q, k)."""
        if (self.native is None or qkv.dtype != self.cos.dtype or qkv.stride(1) != 1
                or positions.dtype != torch.int64 or not positions.is_contiguous()):
            return False
        self.native.rotary_(qkv, positions, self.cos, self.sin, num_q, num_k, head_dim)
        return True

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, d]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedActivation(nn.Module):
    """act(gate) * up for a fused [T, gate | up] activation (the gated MLPs)."""

    native = None  # kvserve.kernels.Kernels when configured to use them

    def __init__(self, name: str) -> None:
        super().__init__()
        self.act = activation(name)
        self.is_silu = name in ("silu", "swish")

    def configure(self, mode: ExecutionMode) -> None:
        self.native = mode.kernels if self.is_silu else None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native is not None and gate_up.dim() == 2 and gate_up.dtype == torch.float32:
            return self.native.silu_mul(gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


def activation(name: str):
    if name in ("silu", "swish"):
        return F.silu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "relu":
        return F.relu
    raise ValueError(f"activation {name!r} is not supported; supported: silu, gelu, gelu_new, relu")

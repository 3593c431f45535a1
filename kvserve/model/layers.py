"""Small building blocks shared by the model families."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import NATIVE_ELEMENTWISE_DTYPES
from kvserve.model.config import RopeConfig
from kvserve.model.execution import ExecutionMode


class Linear(nn.Linear):
    """nn.Linear that can run on oneDNN with its weight packed once, as vLLM's CPU build does.

    MKL's GEMM behind F.linear streams weights that come cold from memory (as at every
    step of a model larger than the cache) well below the CPU's peak; oneDNN with the
    weight reordered once into its blocked layout streams them well at every batch
    size. The packed copy doubles the memory of the linear weights; the dense copy is
    kept for few-row GEMMs, which ran slower on oneDNN's (its fixed cost per call), unless
    the layer has panels (below) that serve them: the worker then lets it go at the end
    of start-up (``release_dense_weight``).
    """

    step_part = "linear"  # for the step profiler (kvserve/worker/step_profiler.py)
    packed_weight: torch.Tensor | None = None
    min_rows: int = 1  # a packed GEMM of fewer rows runs on min_rows rows, the real ones first
    # GEMMs of up to this many rows run on the dense weight instead (set by measurement:
    # oneDNN's fixed cost per call outweighs its streaming on small weights)
    dense_max_rows: int = 0
    # ...or through the native few-row GEMV (these kernels), when measured faster: over
    # the panels where the layer has them, else over the dense weight
    native_max_rows: int = 0
    native = None
    # the weight packed in panels (kernels.pack_panels), where the worker packed it: read
    # by the few-row GEMV above and, from panel_min_rows (more than the few-row paths
    # take) to panel_max_rows rows, by the native panel GEMM where measured faster than
    # oneDNN (worker/panel_gemm.py)
    panel_weight: torch.Tensor | None = None
    panel_min_rows: int = 9
    panel_max_rows: int = 0
    panel_gemm = None
    # whether the few-row GEMV reads the panels (where there are any) or the dense
    # weight: which streams faster is the CPU's business, measured at start for the
    # whole model (worker/gemv_weights.py)
    gemv_reads_panels: bool = True
    _padded: torch.Tensor | None = None

    def configure(self, mode: ExecutionMode) -> None:
        """Packed (once) when the mode asks and oneDNN runs this dtype well; padded to
        ``mode.linear_min_rows`` rows when packed. The dense weight comes back first if
        it was let go: every path is open again until the worker chooses."""
        self.restore_dense_weight()
        if mode.packed_linear and packable(self.weight.dtype):
            if self.packed_weight is None:
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                    self.weight.detach().contiguous())
        else:
            self.packed_weight = None
        self.min_rows = mode.linear_min_rows if self.packed_weight is not None else 1
        self.dense_max_rows = self.native_max_rows = 0
        self.native = None
        self._padded = None

    @property
    def gemv_on_panels(self) -> bool:
        return self.panel_weight is not None and self.gemv_reads_panels

    def release_dense_weight(self) -> int:
        """Let the dense weight go where the panels hold the same numbers and no path
        of this layer reads it (no dense few-row GEMMs, the GEMV on the panels): the
        Parameter becomes a meta tensor of its shape and dtype (what reads it here fails
        loudly). Returns the bytes let go."""
        w = self.weight
        if not self.gemv_on_panels or self.dense_max_rows or w.is_meta:
            return 0
        self.weight = nn.Parameter(torch.empty_like(w, device="meta"), requires_grad=False)
        return w.numel() * w.element_size()

    def restore_dense_weight(self) -> None:
        """The dense weight back from the panels, if it was let go."""
        if self.weight.is_meta:
            n, k = self.weight.shape
            dense = self.panel_weight.transpose(1, 2).reshape(n, k).contiguous()
            self.weight = nn.Parameter(dense, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # rows are independent: the paths below take them flat
            flat = self(x.reshape(-1, x.shape[-1]))
            return flat.reshape(*x.shape[:-1], self.out_features)
        if x.shape[0] == 0:  # a step with no rows here (none to sample, say)
            return x.new_empty((0, self.out_features))
        if x.shape[0] <= self.native_max_rows and x.dtype == torch.float32:
            if self.gemv_on_panels:
                return self.native.gemv_panels(x, self.panel_weight, self.bias)
            return self.native.gemv_rows(x.contiguous(), self.weight, self.bias)
        if self.packed_weight is None or x.shape[0] <= self.dense_max_rows:
            if self.weight.is_meta:  # torch would compute on it, returning meta tensors
                raise RuntimeError("this layer's dense weight was let go (its panels serve "
                                   "its few-row GEMMs); configure() brings it back")
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if self.panel_min_rows <= rows <= self.panel_max_rows and x.dtype == torch.float32:
            return self.panel_gemm(x, self.panel_weight, self.bias)
        if rows < self.min_rows:
            # GEMM rows are independent: the padding rows (left from earlier calls)
            # change nothing in the real ones, whose results are sliced out
            if (self._padded is None or self._padded.shape[0] != self.min_rows
                    or self._padded.dtype != x.dtype):
                self._padded = x.new_zeros(self.min_rows, x.shape[1])
            self._padded[:rows].copy_(x)
            x = self._padded
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias,
                                                 "none", [], "")
        return out[:rows] if rows < out.shape[0] else out


def packed_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def packed_bf16_available() -> bool:
    """oneDNN runs bf16 GEMMs in hardware here (AVX512-BF16 or AMX)."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return packed_linear_available() and supported is not None and bool(supported())


def packable(dtype: torch.dtype) -> bool:
    """float32 always (where oneDNN is there); bfloat16 where oneDNN runs it in hardware."""
    if dtype == torch.float32:
        return packed_linear_available()
    return dtype == torch.bfloat16 and packed_bf16_available()


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

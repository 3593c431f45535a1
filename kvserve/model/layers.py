"""Small building blocks shared by the model families."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import NATIVE_ELEMENTWISE_DTYPES
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
        # LoRA adapters' slots (kvserve.lora.layers.LoRALayer), when the engine serves them
        self.lora = None

    def configure(self, mode: ExecutionMode) -> None:
        self.method.configure(self, mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            flat = self(x.reshape(-1, x.shape[-1]))
            return flat.reshape(*x.shape[:-1], self.out_features)
        if x.shape[0] == 0:  # a step with no rows here (none to sample, say)
            return x.new_empty((0, self.out_features))
        out = self.method.apply(self, x)
        if self.lora is not None and self.lora.rows.slots is not None:
            self.lora.add_to(x, out)
        return out


# glibc serves allocations of 32 MiB and more (its largest mmap threshold) with fresh
# pages from the kernel at every call; keeping each MLP intermediate under half that
# lets the heap reuse it, with no page faults inside a step.
MAX_INTERMEDIATE_BYTES = 16 * 2**20


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding left uninitialised: its weight comes from the checkpoint. (Its own
    normal_ init, on the meta device the loader builds models on, would import torch's
    compiler stack: seconds of start-up for nothing.)"""
    return nn.Embedding(num_embeddings, embedding_dim,
                        _weight=torch.empty(num_embeddings, embedding_dim))


def in_row_chunks(fn, x: torch.Tensor, row_elements: int, lora_rows=None) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn``, run on row chunks whose largest intermediate
    (``row_elements`` per row, counted at 4 bytes: float32, or an int8 layer's int32
    sums) stays under MAX_INTERMEDIATE_BYTES; a row larger than that runs alone.
    ``lora_rows``: the step's LoRA rows (kvserve.lora.layers.LoRARows), told where each
    chunk starts."""
    rows = max(1, MAX_INTERMEDIATE_BYTES // (4 * row_elements))
    if x.shape[0] <= rows:
        return fn(x)
    if lora_rows is None or lora_rows.slots is None:
        return torch.cat([fn(chunk) for chunk in x.split(rows)])
    outs = []
    for start in range(0, x.shape[0], rows):
        lora_rows.offset = start
        outs.append(fn(x[start:start + rows]))
    lora_rows.offset = 0
    return torch.cat(outs)


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

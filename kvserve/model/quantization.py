"""int8 quantization of the linear layers: int8 weights, int8 activations, int32 sums.

``--quantization int8`` stores each linear weight as int8 with one scale per output
channel (symmetric: w ~= q * scale, |q| <= 127) and, at run time, quantizes each
token's activations the same way with that token's own scale. The matmul runs on
int8 x int8 -> int32 (``torch._int_mm``: oneDNN's VNNI / AVX2 integer kernels), which on
this class of CPU multiplies several times faster than float32 GEMM and reads a
quarter of the weight bytes. The int32 sums are exact, so a token's output depends on
that token alone: results do not change with batch composition, and are reproduced
exactly by a reference that quantizes the same way (``int8_reference_linear``).

Why not weight-only int8 with float activations: the multiplications would still run
in float32, so batched steps would be no faster; torch's weight-only int8 CPU kernel
is in fact far slower than float32 GEMM.

The embeddings and the LM head stay in the compute dtype (as vLLM's int8 schemes
leave them): the head is a small share of the FLOPs and most sensitive to rounding.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from kvserve.config.validate import choice

QUANTIZATION_METHODS = ("int8",)  # the --quantization choices
_QMAX = 127


def check_quantization(method: str | None) -> None:
    """Refuse a quantization setting that names no method here (None: none)."""
    if method is not None:
        choice("quantization", method, QUANTIZATION_METHODS)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a float matrix: (q [R, C] int8, scale [R] float32)
    with x ~= q * scale[:, None]; an all-zero row gets scale 1 (and q = 0)."""
    amax = x.abs().amax(dim=1).float()
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
    q = torch.round(x.float() / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """A linear layer computed as int8 x int8 -> int32, then rescaled to float.

    Buffers: ``qweight`` [out, in] int8, ``weight_scale`` [out] float32, optional
    ``bias`` [out] in the compute dtype. Inputs are 2-D [tokens, in].
    """

    step_part = "linear"  # for the step profiler

    native = None  # kvserve.kernels.Kernels (quantize / rescale passes) when configured

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)
        self.out_dtype = dtype

    def configure(self, mode) -> None:
        """Native quantize / rescale passes for a float32 model (kvserve.model.execution)."""
        self.native = mode.kernels if self.out_dtype == torch.float32 else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        weight = linear.weight.detach()
        qweight, scale = quantize_rows(weight)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(qweight, scale, bias, weight.dtype)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # one activation scale per token
        if self.native is not None and rows.dtype == torch.float32:
            xq, x_scale = self.native.quantize_rows(rows.contiguous())
            acc = torch._int_mm(xq, self.qweight.t())
            out = self.native.rescale_int32(acc, x_scale, self.weight_scale, self.bias)
        else:
            xq, x_scale = quantize_rows(rows)
            acc = torch._int_mm(xq, self.qweight.t())
            out = acc.float() * x_scale[:, None] * self.weight_scale[None, :]
            if self.bias is not None:
                out = out + self.bias.float()
            out = out.to(self.out_dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


@functools.cache
def int8_matmul_is_exact() -> bool:
    """Whether ``torch._int_mm`` sums int8 products exactly on this CPU. With int8
    dot-product instructions (VNNI) it does; without them oneDNN may pair products into
    saturating 16-bit sums or halve the weights, which this probe of extreme values
    (a row and a column of +-127) catches."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (16, 256), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (256, 32), dtype=torch.int8, generator=g)
    a[0], a[1], b[:, 0], b[:, 1] = 127, -127, 127, -127
    b[::2, 2] = -127
    b[1::2, 2] = 127
    return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())


def quantize_model(model: nn.Module, method: str) -> int:
    """Replace every linear layer except the LM head by its ``method`` form (in place);
    returns how many were replaced. The float weights are released."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {method!r} is not supported; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if not int8_matmul_is_exact():
        raise ValueError("quantization 'int8' needs an int8 matmul that sums exactly; "
                         "torch._int_mm on this CPU does not (no VNNI int8 instructions?): "
                         "run without --quantization")
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and not name.startswith("lm_head")]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear.from_linear(linear))
    return len(targets)


def int8_reference_linear(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """What an int8 layer computes, in float64 from the float weight: the oracle the
    quantized engine is tested against (the sums of int8 products are exact in both)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, x_scale = quantize_rows(x2)
    wq, w_scale = quantize_rows(weight)
    acc = (xq.double() @ wq.double().t()).float()
    out = acc * x_scale[:, None] * w_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*shape[:-1], weight.shape[0])

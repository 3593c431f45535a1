"""int8 quantization of the linear layers: int8 weights, int8 activations, int32 sums.

``--quantization int8`` stores each linear weight as int8 with one scale per output
channel (symmetric: w ~= q * scale, |q| <= 127) and, at run time, quantizes each
token's activations the same way with that token's own scale. The matmul runs on
int8 x int8 -> int32: with AVX-512 VNNI on the weight kept in runs of eight rows
(``kernels/int8_runs.c``), for every row count; else the native ``int8_matmul`` for
decode rows and ``torch._int_mm`` (oneDNN's kernels) for more where the CPU has VNNI,
and the native kernel for all rows where it has not (torch's int8 GEMM then takes a
path about a hundred times slower); it reads a quarter of float32's weight bytes. The
int32 sums are exact, so a token's output depends on that token alone: results do not
change with batch composition, and are reproduced exactly by a reference that quantizes
the same way (``int8_reference_linear``).

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
from kvserve.kernels.build import cpu_has_any
from kvserve.kernels.weight_formats import WeightFormatKernels
from kvserve.model.layers import Linear
from kvserve.model.linear_method import LinearMethod

QUANTIZATION_METHODS = ("int8",)  # the --quantization choices
_QMAX = 127
# with VNNI, the rows up to which the native int8 kernel beats torch._int_mm (see configure)
NATIVE_INT8_ROWS = 16


def check_quantization(method: str | None) -> None:
    """Refuse a quantization setting that names no method here (None: none)."""
    if method is not None:
        choice("quantization", method, QUANTIZATION_METHODS)


def quantize_rows(x: torch.Tensor, divisor: float = _QMAX
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a float matrix: (q [R, C] int8, scale [R] float32)
    with x ~= q * scale[:, None], scale = max|row| / ``divisor`` (127: |q| <= 127;
    compressed-tensors' 127.5 uses -128 too); an all-zero row gets scale 1 (and q = 0)."""
    amax = x.abs().amax(dim=1).float()
    scale = torch.where(amax > 0, amax / divisor, torch.ones_like(amax))
    q = torch.round(x.float() / scale[:, None]).clamp_(-_QMAX - 1, _QMAX).to(torch.int8)
    return q, scale


class Int8LinearMethod(LinearMethod):
    """A linear layer computed as int8 x int8 -> int32, then rescaled to float.

    ``install`` turns a layer's float weight into buffers ``qweight`` [out, in] int8 and
    ``weight_scale`` [out] float32 (the float weight is let go); the bias stays in the
    compute dtype. Each call quantizes its rows, one scale per token.
    """

    def __init__(self, out_dtype: torch.dtype | None, divisor: float = _QMAX) -> None:
        self.out_dtype = out_dtype
        self.divisor = divisor  # each token's scale: max|x| / divisor
        self.native = None  # kvserve.kernels.Kernels (quantize / rescale passes) when configured
        self.sums = None  # kvserve.kernels.Kernels when its int8_matmul makes the int32 sums
        self.sums_max_rows: int | None = None  # ... for up to this many rows (None: any)

    @classmethod
    def install(cls, layer: nn.Linear) -> Int8LinearMethod:
        weight = layer.weight.detach()
        qweight, scale = quantize_rows(weight)
        layer.register_parameter("weight", None)
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("weight_scale", scale)
        layer.method = method = cls(weight.dtype)
        return method

    @classmethod
    def install_empty(cls, layer: nn.Linear) -> Int8LinearMethod:
        """Give ``layer`` (on the meta device, before its weights load) this method with
        empty int8 buffers, for a checkpoint's own int8 weights (``load``), rounding each
        token as compressed-tensors does (scale max|x| / 127.5, codes -128..127); its
        output takes the activations' dtype."""
        meta = torch.device("meta")
        layer.register_parameter("weight", None)
        layer.register_buffer("qweight", torch.empty(layer.out_features, layer.in_features,
                                                     dtype=torch.int8, device=meta))
        layer.register_buffer("weight_scale", torch.empty(layer.out_features, device=meta))
        layer.method = method = cls(None, divisor=127.5)
        return method

    def load(self, layer: nn.Linear, first_row: int, weight) -> None:
        """Rows ``first_row`` onwards from a checkpoint's ``Int8Weight``."""
        rows = weight.qweight.shape[0]
        if weight.qweight.shape[1] != layer.in_features or first_row + rows > layer.out_features:
            raise ValueError(f"an int8 weight of shape {tuple(weight.qweight.shape)} does not "
                             f"fit rows {first_row}:{first_row + rows} of "
                             f"({layer.out_features}, {layer.in_features})")
        layer.qweight[first_row:first_row + rows] = weight.qweight
        layer.weight_scale[first_row:first_row + rows] = weight.scale

    def configure(self, layer: nn.Linear, mode) -> None:
        """Native quantize / rescale passes where the kernels are there; the weight in
        runs of eight rows where they multiply them (AVX-512 VNNI), else the plain int8
        weight (the runs go back to it)."""
        kernels = getattr(mode, "kernels", None)
        kernels = kernels if kernels is not None and kernels.available else None
        self.native = kernels
        # the int32 sums: on the weight's runs for every row count where the kernels have
        # them (int8_runs.c: on Zen 4, 1 row of a 8192 x 2048 weight 0.53 ms, 8 rows
        # 0.72, against 2.3 and 2.4 for torch._int_mm); else the native kernel for decode
        # rows, and for every row count without VNNI (where torch's int8 GEMM takes a
        # path ~100x slower at decode rows); torch._int_mm for more rows with VNNI
        self.sums = kernels
        self.sums_max_rows = NATIVE_INT8_ROWS if cpu_has_vnni() else None
        self._take_runs(layer, kernels)
        if self.out_dtype is None and layer.weight_scale.dtype != torch.float32:
            layer.weight_scale = layer.weight_scale.float()

    def _take_runs(self, layer: nn.Linear, kernels) -> None:
        """``qweight`` in runs of rows (``qweight_runs``, ``qweight_row_sums``) where
        ``kernels`` multiply them, the plain weight let go (a meta tensor); back to the
        plain weight otherwise."""
        runs = getattr(layer, "qweight_runs", None)
        if kernels is not None and runs is None and layer.qweight.device.type == "cpu":
            packed = kernels.int8_pack_runs(layer.qweight.contiguous())
            if packed is not None:
                layer.register_buffer("qweight_runs", packed[0])
                layer.register_buffer("qweight_row_sums", packed[1])
                layer.qweight = torch.empty_like(layer.qweight, device="meta")
        elif kernels is None and runs is not None:
            layer.qweight = WeightFormatKernels.unpack_row_runs(
                runs, layer.out_features, run_rows=8, group=8)
            del layer.qweight_runs, layer.qweight_row_sums

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            xq, x_scale = self.native.quantize_rows(x.float().contiguous(), self.divisor)
            acc = self._int32_sums(layer, xq)
            bias = None if layer.bias is None else layer.bias.float().contiguous()
            out = self.native.rescale_int32(acc, x_scale, layer.weight_scale, bias)
            return out.to(self.out_dtype or x.dtype)
        xq, x_scale = quantize_rows(x, self.divisor)
        acc = self._int32_sums(layer, xq)
        out = acc.float() * x_scale[:, None] * layer.weight_scale[None, :]
        if layer.bias is not None:
            out = out + layer.bias.float()
        return out.to(self.out_dtype or x.dtype)

    def _int32_sums(self, layer: nn.Linear, xq: torch.Tensor) -> torch.Tensor:
        runs = getattr(layer, "qweight_runs", None)
        if runs is not None:
            return self.sums.int8_runs_matmul(xq.contiguous(), runs, layer.qweight_row_sums)
        if (self.sums is not None and xq.device.type == "cpu"
                and (self.sums_max_rows is None or xq.shape[0] <= self.sums_max_rows)):
            return self.sums.int8_matmul(xq.contiguous(), layer.qweight)
        return torch._int_mm(xq, layer.qweight.t())


def cpu_has_vnni() -> bool:
    """True when the CPU has int8 dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX)."""
    return cpu_has_any("avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache
def int8_matmul_is_exact(low: int = -_QMAX) -> bool:
    """Whether ``torch._int_mm`` sums int8 products exactly on this CPU. With int8
    dot-product instructions (VNNI) it does; without them oneDNN may pair products into
    saturating 16-bit sums or halve the weights, which this probe of extreme values
    (a row and a column of 127 and of ``low``: -128 where codes use it) catches."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (16, 256), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (256, 32), dtype=torch.int8, generator=g)
    a[0], a[1], b[:, 0], b[:, 1] = 127, low, 127, low
    b[::2, 2] = low
    b[1::2, 2] = 127
    return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())


def quantize_model(model: nn.Module, method: str) -> int:
    """Give every linear layer except the LM head the ``method``'s linear method (in
    place); returns how many took it. The float weights are released."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {method!r} is not supported; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if not int8_matmul_is_exact():
        raise ValueError("quantization 'int8' needs an int8 matmul that sums exactly; "
                         "torch._int_mm on this CPU does not (no VNNI int8 instructions?): "
                         "run without --quantization")
    targets = [module for name, module in model.named_modules()
               if isinstance(module, Linear) and not name.startswith("lm_head")]
    for linear in targets:
        Int8LinearMethod.install(linear)
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

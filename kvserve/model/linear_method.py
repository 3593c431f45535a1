"""How a linear layer computes: one method object per :class:`~kvserve.model.layers.Linear`
(``layer.method``), as vLLM's ``quant_method``. The layer keeps the weight it loaded
(``layer.weight``, ``layer.bias``); its method owns every other layout of that weight, the
choice of path by row count (``apply``), and what it can let go once start-up has chosen.

The worker installs and tunes methods: ``configure_layers`` passes each layer the
execution mode, and the start-up measurements (``kvserve/worker/tuning/``) set the
method's row limits and panels. A quantized format is one more method here.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.weight_formats import WeightFormatKernels
from kvserve.model.execution import ExecutionMode


class LinearMethod(ABC):
    """The computation of one linear layer: ``apply(layer, x)`` for 2-D ``x`` with at
    least one row."""

    def configure(self, layer: nn.Linear, mode: ExecutionMode) -> None:
        """Take an execution mode (kernels, oneDNN packing); every path is open again."""

    @abstractmethod
    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        ...

    def release_dense_weight(self, layer: nn.Linear) -> int:
        """Let the layer's dense weight go where no path reads it; the bytes let go."""
        return 0

    def restore_dense_weight(self, layer: nn.Linear) -> None:
        """The dense weight back, if it was let go."""


# the rows up to which a bfloat16 layer's steps take its runs (kernels/bf16_runs.c): on
# Zen 4 they beat oneDNN's packed GEMM by 10-40 % at 8-48 rows and 4-8 % at 64, and fall
# behind from 128
BF16_RUNS_MAX_ROWS = 64


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


class FloatLinearMethod(LinearMethod):
    """A float weight in up to three layouts, each row count on the path measured fastest.

    - dense (``layer.weight``): torch's GEMM (MKL), for GEMMs of up to ``dense_max_rows``
      rows, or every GEMM where nothing is packed;
    - oneDNN-packed (``packed_weight``), as vLLM's CPU build runs: MKL's GEMM streams
      weights that come cold from memory (as at every step of a model larger than the
      cache) well below the CPU's peak, oneDNN's blocked layout streams them well at every
      batch size; GEMMs of fewer than ``min_rows`` rows run padded to that many;
    - 16-column panels (``panel_weight``, ``kvserve.kernels.pack_panels``): read by the
      native few-row GEMV (up to ``native_max_rows`` rows, when ``gemv_reads_panels``;
      else the GEMV reads the dense weight) and by the native panel GEMM from
      ``panel_min_rows`` to ``panel_max_rows`` rows.

    - bfloat16 runs of 16 rows (``weight_runs``, a buffer of the layer, ``kernels/
      bf16_runs.c``), where the CPU has AVX512-BF16: every step of up to
      ``runs_max_rows`` rows (decode, short chunks), each weight read once for all of
      them.

    The packed copy doubles the memory of the weights; where the panels or the runs serve
    every path that read the dense weight, ``release_dense_weight`` lets it go at the end
    of start-up.
    """

    def __init__(self) -> None:
        self.packed_weight: torch.Tensor | None = None
        self.min_rows = 1
        self.dense_max_rows = 0  # oneDNN's fixed cost per call outweighs its streaming
        self.native_max_rows = 0
        self.native = None  # kvserve.kernels.Kernels for the few-row GEMV
        self.panel_weight: torch.Tensor | None = None
        self.panel_max_rows = 0
        self.panel_gemm = None
        self.gemv_reads_panels = True  # which streams faster is the CPU's business
        self._padded: torch.Tensor | None = None
        self.runs_max_rows = 0
        self.runs_kernels = None  # kvserve.kernels.Kernels multiplying weight_runs
        self._bias_f32: torch.Tensor | None = None

    panel_min_rows = 9  # more rows than the few-row paths take

    def configure(self, layer: nn.Linear, mode: ExecutionMode) -> None:
        """Packed (once) when the mode asks and oneDNN runs this dtype well; padded to
        ``mode.linear_min_rows`` rows when packed. The dense weight comes back first if
        it was let go: every path is open again until the worker chooses."""
        self.restore_dense_weight(layer)
        if mode.packed_linear and packable(layer.weight.dtype):
            if self.packed_weight is None:
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                    layer.weight.detach().contiguous())
        else:
            self.packed_weight = None
        self.min_rows = mode.linear_min_rows if self.packed_weight is not None else 1
        self.dense_max_rows = self.native_max_rows = 0
        self.native = None
        self._padded = None
        self._take_bf16_runs(layer, getattr(mode, "kernels", None))

    def _take_bf16_runs(self, layer: nn.Linear, kernels) -> None:
        """A bfloat16 weight on oneDNN's packed path also in runs of rows, for decode
        steps, where the kernels multiply them; none otherwise."""
        self.runs_max_rows, self.runs_kernels = 0, None
        usable = (layer.weight.dtype == torch.bfloat16 and self.packed_weight is not None
                  and kernels is not None and kernels.available)
        if not usable:
            if hasattr(layer, "weight_runs"):
                del layer.weight_runs
            return
        if getattr(layer, "weight_runs", None) is None:
            runs = kernels.bf16_pack_runs(layer.weight.detach().contiguous())
            if runs is None:
                return
            layer.register_buffer("weight_runs", runs)
        self.runs_max_rows, self.runs_kernels = BF16_RUNS_MAX_ROWS, kernels
        self._bias_f32 = None if layer.bias is None else layer.bias.detach().float()

    @property
    def gemv_on_panels(self) -> bool:
        return self.panel_weight is not None and self.gemv_reads_panels

    def release_dense_weight(self, layer: nn.Linear) -> int:
        """Let the dense weight go where the panels (the GEMV on them) or the bf16 runs
        hold the same numbers and no path reads it (no dense few-row GEMMs): the
        Parameter becomes a meta tensor of its shape and dtype (what reads it fails
        loudly)."""
        w = layer.weight
        held = self.gemv_on_panels or getattr(layer, "weight_runs", None) is not None
        if not held or self.dense_max_rows or w.is_meta:
            return 0
        layer.weight = nn.Parameter(torch.empty_like(w, device="meta"), requires_grad=False)
        return w.numel() * w.element_size()

    def restore_dense_weight(self, layer: nn.Linear) -> None:
        """The dense weight back from the panels or the runs, if it was let go."""
        if layer.weight.is_meta:
            n, k = layer.weight.shape
            if self.panel_weight is not None:
                dense = self.panel_weight.transpose(1, 2).reshape(n, k).contiguous()
            else:
                dense = WeightFormatKernels.unpack_row_runs(layer.weight_runs, n,
                                                            run_rows=16, group=2)
            layer.weight = nn.Parameter(dense, requires_grad=False)

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.runs_max_rows and x.dtype == torch.bfloat16:
            return self.runs_kernels.bf16_runs_matmul(x.contiguous(), layer.weight_runs,
                                                      layer.out_features, self._bias_f32)
        if rows <= self.native_max_rows and x.dtype == torch.float32:
            if self.gemv_on_panels:
                return self.native.gemv_panels(x, self.panel_weight, layer.bias)
            return self.native.gemv_rows(x.contiguous(), layer.weight, layer.bias)
        if self.packed_weight is None or rows <= self.dense_max_rows:
            if layer.weight.is_meta:  # torch would compute on it, returning meta tensors
                raise RuntimeError("this layer's dense weight was let go (its panels serve "
                                   "its few-row GEMMs); configure() brings it back")
            return F.linear(x, layer.weight, layer.bias)
        if self.panel_min_rows <= rows <= self.panel_max_rows and x.dtype == torch.float32:
            return self.panel_gemm(x, self.panel_weight, layer.bias)
        if rows < self.min_rows:
            # GEMM rows are independent: the padding rows (left from earlier calls)
            # change nothing in the real ones, whose results are sliced out
            if (self._padded is None or self._padded.shape[0] != self.min_rows
                    or self._padded.dtype != x.dtype):
                self._padded = x.new_zeros(self.min_rows, x.shape[1])
            self._padded[:rows].copy_(x)
            x = self._padded
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, layer.bias,
                                                 "none", [], "")
        return out[:rows] if rows < out.shape[0] else out

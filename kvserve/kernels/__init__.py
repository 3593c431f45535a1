"""Small native kernels, compiled with the system C compiler on first use.

Plain C through ctypes (no torch headers): a build is quick and cached under a key of
its sources, flags, CPU and compiler (:mod:`kvserve.kernels.build`). Without a compiler,
or when the build fails, kvserve runs its slower torch paths and says so (a warning,
``/health``, ``kernels_compiled``). Each C signature is declared once, in
:mod:`kvserve.kernels.signatures`, and checked against the sources at load.
"""
from __future__ import annotations

import ctypes
import functools
import subprocess

import torch

from kvserve.kernels.build import HEADERS, SOURCES, build_library
from kvserve.kernels.signatures import bind, check_against_sources
from kvserve.kernels.weight_formats import WeightFormatKernels
from kvserve.logger import init_logger

logger = init_logger(__name__)

# KV pool element types the attention kernel reads (queries and sums are float32)
NATIVE_KV_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# activation dtypes of the RMSNorm and rotary kernels (SiLU-and-multiply: float32)
NATIVE_ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)
PANEL_COLUMNS = 16  # output columns of one panel of gemm_panels' weight layout

class Kernels(WeightFormatKernels):
    """Loaded native kernels; ``available`` is False when they could not be built.

    ``extra_flags`` are added to the compiler's (tests build the AVX2 paths on an AVX-512
    machine with ``-mno-avx512f``)."""

    def __init__(self, extra_flags: tuple[str, ...] = ()) -> None:
        self.available = False
        self.reason = ""
        try:
            lib = ctypes.CDLL(str(build_library(extra_flags)))
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            detail = (getattr(e, "stderr", "") or str(e)).strip()
            self.reason = detail.splitlines()[-1] if detail else repr(e)
            if isinstance(e, subprocess.CalledProcessError):
                self.reason = f"the C build failed: {self.reason}"
            logger.warning("native kernels not built (%s): the slower torch paths run "
                           "instead", self.reason)
            return
        check_against_sources(SOURCES + HEADERS)
        self._attention = {dtype: bind(lib, "paged_attention_rows", f"paged_attention_rows_{sfx}")
                           for dtype, sfx in NATIVE_KV_DTYPES.items()}
        self._write_kv = {dtype: bind(lib, "write_kv", f"write_kv_{sfx}")
                          for dtype, sfx in NATIVE_KV_DTYPES.items()}
        self._rms_norm = {torch.float32: bind(lib, "rms_norm"),
                          torch.bfloat16: bind(lib, "rms_norm_bf16")}
        self._add_rms_norm = {torch.float32: bind(lib, "add_rms_norm"),
                              torch.bfloat16: bind(lib, "add_rms_norm_bf16")}
        self._silu_mul = bind(lib, "silu_mul")
        self._gemv_rows = bind(lib, "gemv_rows")
        self._gemm_panels = bind(lib, "gemm_panels")
        self._gemv_panels = bind(lib, "gemv_panels")
        self._head_rms_norm = bind(lib, "head_rms_norm")
        self._moe_route = bind(lib, "moe_route")
        self._rotary = {torch.float32: bind(lib, "rotary"),
                        torch.bfloat16: bind(lib, "rotary_bf16")}
        self._quantize_rows = bind(lib, "quantize_rows_int8")
        self._rescale_int32 = bind(lib, "rescale_int32")
        self._int8_matmul = bind(lib, "int8_matmul")
        self._int8_pack_runs = bind(lib, "int8_pack_runs")
        self._int8_runs_matmul = bind(lib, "int8_runs_matmul")
        self._bf16_pack_runs = bind(lib, "bf16_pack_runs")
        self._bf16_runs_matmul = bind(lib, "bf16_runs_matmul")
        self._lora_rows = bind(lib, "lora_rows")
        self._gguf_rows = bind(lib, "gguf_rows")
        self._gguf_rows_int8 = bind(lib, "gguf_rows_int8")
        self._gguf_dequantize = bind(lib, "gguf_dequantize")
        self._gguf_dequantize_row = bind(lib, "gguf_dequantize_row")
        self._gguf_repack_runs = bind(lib, "gguf_repack_runs")
        self._int4_rows = bind(lib, "int4_rows")
        self._int4_dequantize = bind(lib, "int4_dequantize")
        self._bind_threads = bind(lib, "bind_omp_threads")
        self._release_threads = bind(lib, "release_omp_threads")
        self._captured_step = bind(lib, "captured_step")
        self.available = True

    def paged_attention_rows(self, q, k_pool, v_pool, tables, seq_lens, out, scale: float,
                             window: int) -> None:
        """q/out [S, H, D] float32, out contiguous, q's rows H x D contiguous (the q part
        of fused qkv rows is: read in place); pools k [B, KVH, D, bs] and v [B, KVH, bs, D]
        of a NATIVE_KV_DTYPES type; tables/seq_lens int64."""
        s, h, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        _, kvh, _, bs = k_pool.shape
        self._attention[k_pool.dtype](
            q=q.data_ptr(), q_stride=q.stride(0), k_pool=k_pool.data_ptr(),
            v_pool=v_pool.data_ptr(), tables=tables.data_ptr(), table_stride=tables.stride(0),
            seq_lens=seq_lens.data_ptr(), out=out.data_ptr(), num_seqs=s, num_heads=h,
            num_kv_heads=kvh, head_dim=d, block_size=bs, scale=scale, window=window)

    def write_kv(self, k, v, slots, k_pool, v_pool) -> None:
        """Write k/v [T, KVH, D] of the pools' dtype, each token's KVH x D contiguous (rows
        of a fused qkv are), into the pools (laid out as for paged_attention_rows) at flat
        slots [T] int64."""
        _, kvh, d, bs = k_pool.shape
        self._write_kv[k_pool.dtype](
            k=k.data_ptr(), v=v.data_ptr(), k_stride=k.stride(0), v_stride=v.stride(0),
            slots=slots.data_ptr(), n=slots.shape[0], k_pool=k_pool.data_ptr(),
            v_pool=v_pool.data_ptr(), num_kv_heads=kvh, head_dim=d, block_size=bs)

    def rms_norm(self, x, weight, eps: float):
        """RMSNorm of rows x [T, D] (contiguous) with weight [D], both float32 or both
        bfloat16 (NATIVE_ELEMENTWISE_DTYPES)."""
        out = torch.empty_like(x)
        self._rms_norm[x.dtype](x=x.data_ptr(), weight=weight.data_ptr(), out=out.data_ptr(),
                                rows=x.shape[0], dim=x.shape[1], eps=eps)
        return out

    def add_rms_norm(self, x, residual, weight, eps: float):
        """residual += x in place, then RMSNorm(residual) returned; x, residual [T, D]
        contiguous, all three of one NATIVE_ELEMENTWISE_DTYPES type."""
        out = torch.empty_like(x)
        self._add_rms_norm[x.dtype](x=x.data_ptr(), residual=residual.data_ptr(),
                                    weight=weight.data_ptr(), out=out.data_ptr(),
                                    rows=x.shape[0], dim=x.shape[1], eps=eps)
        return out

    def silu_mul(self, gate_up):
        """silu(gate) * up for float32 gate_up [T, 2I] (contiguous) -> [T, I]."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty((rows, inter))
        self._silu_mul(gate_up=gate_up.data_ptr(), out=out.data_ptr(), rows=rows, inter=inter)
        return out

    def gemv_rows(self, x, weight, bias=None):
        """x [M, K] @ weight[N, K].T (+ bias) for float32, contiguous x and weight, M of
        1-8 (more rows run in groups of eight, re-reading the weight)."""
        if not (x.dtype == weight.dtype == torch.float32 and x.is_contiguous()
                and weight.is_contiguous() and x.shape[1] == weight.shape[1]
                and x.device.type == weight.device.type == "cpu"):
            raise ValueError(f"gemv_rows takes contiguous float32 CPU x [M, K] and weight "
                             f"[N, K]; got {x.dtype} {tuple(x.shape)} and {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        m, k = x.shape
        out = x.new_empty((m, weight.shape[0]))
        self._gemv_rows(x=x.data_ptr(), m=m, k=k, w=weight.data_ptr(), n=weight.shape[0],
                        bias=bias.data_ptr() if bias is not None else None,
                        y=out.data_ptr())
        return out

    @staticmethod
    def pack_panels(weight, out=None):
        """A float32 weight [N, K] (N a multiple of PANEL_COLUMNS) as gemm_panels reads
        it: panels [N / 16, K, 16] of 16 output columns each; written into ``out`` (of
        that shape) when given, in one pass."""
        n, k = weight.shape
        if weight.dtype != torch.float32 or n % PANEL_COLUMNS or weight.device.type != "cpu":
            raise ValueError(f"pack_panels takes a float32 CPU weight [N, K] with N a multiple "
                             f"of {PANEL_COLUMNS}; got {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        panels = weight.detach().reshape(n // PANEL_COLUMNS, PANEL_COLUMNS, k).transpose(1, 2)
        return panels.contiguous() if out is None else out.copy_(panels)

    @staticmethod
    def _panel_input(x, panels):
        """x as the panel kernels read it (contiguous), after checking it fits the panels."""
        _, k, cols = panels.shape
        if not (x.dtype == panels.dtype == torch.float32 and x.dim() == 2
                and x.shape[1] == k and cols == PANEL_COLUMNS
                and x.device.type == panels.device.type == "cpu"):
            raise ValueError(f"the panel kernels take float32 CPU x [M, {k}] and panels "
                             f"[N/16, K, 16]; got {x.dtype} {tuple(x.shape)} on {x.device} "
                             f"and {tuple(panels.shape)} on {panels.device}")
        return x.contiguous()

    def gemm_panels(self, x, panels, bias=None):
        """x [M, K] @ weight.T (+ bias) for float32 x and the weight's ``pack_panels``."""
        x = self._panel_input(x, panels)
        n = panels.shape[0] * PANEL_COLUMNS
        out = x.new_empty((x.shape[0], n))
        status = self._gemm_panels(x=x.data_ptr(), m=x.shape[0], k=x.shape[1],
                                   panels=panels.data_ptr(), n=n,
                                   bias=bias.data_ptr() if bias is not None else None,
                                   y=out.data_ptr())
        if status != 0:
            raise MemoryError(f"gemm_panels of {x.shape[0]} rows: no memory for its input copy")
        return out

    def gemv_panels(self, x, panels, bias=None):
        """As ``gemm_panels``, for x of 1-8 rows: a stream over the panels (more rows
        run as further tiles over each panel)."""
        x = self._panel_input(x, panels)
        n = panels.shape[0] * PANEL_COLUMNS
        out = x.new_empty((x.shape[0], n))
        self._gemv_panels(x=x.data_ptr(), m=x.shape[0], k=x.shape[1], panels=panels.data_ptr(),
                          n=n, bias=bias.data_ptr() if bias is not None else None,
                          y=out.data_ptr())
        return out

    def head_rms_norm_(self, qkv, q_weight, k_weight, num_q: int, num_k: int, head_dim: int,
                       eps: float) -> None:
        """RMSNorm each q head (weight q_weight) and k head (k_weight) at the start of each
        qkv row in place (float32; rows of any stride, each row contiguous)."""
        self._head_rms_norm(qkv=qkv.data_ptr(), row_stride=qkv.stride(0), rows=qkv.shape[0],
                            q_weight=q_weight.data_ptr(), k_weight=k_weight.data_ptr(),
                            num_q=num_q, num_k=num_k, head_dim=head_dim, eps=eps)

    def moe_route(self, x, router, top_k: int, norm: bool):
        """Each row's top_k experts [T, top_k] int64 and their weights [T, top_k] float32
        (the largest first) from float32 rows x [T, H] and a router weight [E, H], both
        contiguous: softmax over the logits, the top k, renormalised with ``norm``
        (kernels/moe_route.c; the captured step routes through the same loops)."""
        rows, experts = x.shape[0], router.shape[0]
        logits = x.new_empty((rows, experts))
        chosen = torch.empty((rows, top_k), dtype=torch.int64)
        weights = x.new_empty((rows, top_k))
        if rows and self._moe_route(x=x.data_ptr(), rows=rows, hidden=x.shape[1], w=router.data_ptr(),
                           experts=experts, top_k=top_k, norm=int(norm),
                           logits=logits.data_ptr(), chosen=chosen.data_ptr(),
                           weights=weights.data_ptr()):
            raise ValueError(f"moe_route: {rows} rows, top {top_k} of {experts} experts")
        return chosen, weights

    def rotary_(self, qkv, positions, cos, sin, num_q: int, num_k: int, head_dim: int):
        """Rotate the q and k heads at the start of each qkv row in place (qkv and the
        cos/sin tables all float32 or all bfloat16)."""
        self._rotary[qkv.dtype](qkv=qkv.data_ptr(), row_stride=qkv.stride(0),
                                rows=qkv.shape[0], positions=positions.data_ptr(),
                                cos_table=cos.data_ptr(), sin_table=sin.data_ptr(),
                                num_q=num_q, num_k=num_k, head_dim=head_dim)

    def captured_step(self, plan: int, tokens: int, positions: int, slots: int, tables: int,
                      table_stride: int, seq_lens: int, rows: int, eps: float, scale: float,
                      logits: int, timings: int) -> None:
        """A Llama-family step of float32 weights and pool (kernels/decode_step.c), its
        arguments addresses: the int64 ``plan``; logits [rows, vocab] (float32,
        contiguous) of tokens [rows]; positions, slots, seq_lens [rows] and tables [rows,
        table_stride] are int64; ``timings``: 0, or a float64 [2] that the GEMVs' and
        attention's seconds add to. The caller keeps what they point to alive."""
        status = self._captured_step(
            plan=plan, tokens=tokens, positions=positions, slots=slots, tables=tables,
            table_stride=table_stride, seq_lens=seq_lens, rows=rows, eps=eps, scale=scale,
            logits=logits, timings=timings or None)
        if status != 0:
            raise MemoryError(f"captured step of {rows} rows: no scratch memory")

    def lora_rows(self, x, slots, a, b, ranks, max_rank: int, bounds, out) -> None:
        """out [T, N] += each row's adapter product (kvserve/lora/layers.py): x [T, K],
        a [S, W, K] and out float32 contiguous, b [S, W, N] float32 with rows of any
        stride (padded), slots [T] (-1: none), ranks [S] and bounds [slices + 1] int64,
        W = slices x max_rank."""
        if not (x.dtype == a.dtype == b.dtype == out.dtype == torch.float32
                and x.is_contiguous() and a.is_contiguous() and out.is_contiguous()
                and slots.is_contiguous() and b.stride(2) == 1
                and b.stride(0) == b.shape[1] * b.stride(1)):
            raise ValueError("lora_rows takes contiguous float32 x, a and out, and b's rows "
                             "contiguous")
        shrunk = x.new_empty((x.shape[0], a.shape[1]))
        failed = self._lora_rows(x=x.data_ptr(), rows=x.shape[0], in_dim=x.shape[1],
                                 slots=slots.data_ptr(), num_slots=a.shape[0],
                                 a=a.data_ptr(), b=b.data_ptr(), b_stride=b.stride(1),
                                 ranks=ranks.data_ptr(), max_rank=max_rank,
                                 bounds=bounds.data_ptr(), num_slices=bounds.shape[0] - 1,
                                 shrunk=shrunk.data_ptr(), out=out.data_ptr())
        if failed:
            raise ValueError(f"lora_rows failed ({failed}): more than 256 slots, or no memory")


    def bind_threads(self, cpus: list[int]) -> int:
        """Bind the calling thread's OpenMP team of len(cpus) threads (torch's intra-op
        threads, when torch runs that many) one to each CPU; returns how many threads could
        not be bound."""
        ids = torch.tensor(cpus, dtype=torch.int64)
        return self._bind_threads(cpus=ids.data_ptr(), n=len(cpus))

    def release_threads(self, cpus: list[int], threads: int) -> int:
        """Let each thread of the calling thread's OpenMP team of ``threads`` run on any
        of ``cpus`` (what bind_threads narrowed); returns how many threads failed."""
        ids = torch.tensor(cpus, dtype=torch.int64)
        return self._release_threads(cpus=ids.data_ptr(), ncpus=len(cpus), n=threads)


@functools.cache
def load_kernels() -> Kernels:
    """The process's kernels, built on first call."""
    return Kernels()

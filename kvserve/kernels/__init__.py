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
from kvserve.logger import init_logger

logger = init_logger(__name__)

# KV pool element types the attention kernel reads (queries and sums are float32)
NATIVE_KV_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# activation dtypes of the RMSNorm and rotary kernels (SiLU-and-multiply: float32)
NATIVE_ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)
PANEL_COLUMNS = 16  # output columns of one panel of gemm_panels' weight layout
# the formats kept in runs of rows: gguf_linear.c's code for the file's format, the values
# of its block, its bytes a block of a row, the runs' bytes a block of a row, and the rows
# of a run
RUNS = {"Q4_K": (2, 256, 144, 148, 4), "Q5_K": (3, 256, 176, 180, 4),
        "Q6_K": (4, 256, 210, 210, 4), "Q8_0": (0, 32, 34, 34, 8)}


class Kernels:
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

    @staticmethod
    def _gguf_args(x, blocks, fmt: int, out) -> dict:
        if not (x.dtype == out.dtype == torch.float32 and x.is_contiguous()
                and blocks.dtype == torch.uint8 and blocks.is_contiguous()
                and out.stride(1) == 1 and out.shape[0] == x.shape[0]
                and out.shape[1] == blocks.shape[0]):
            raise ValueError("gguf_rows takes contiguous float32 x [M, K], uint8 blocks "
                             "[N, bytes] and float32 out [M, N] with contiguous rows")
        return dict(x=x.data_ptr(), m=x.shape[0], k=x.shape[1], w=blocks.data_ptr(),
                    n=blocks.shape[0], fmt=fmt, y=out.data_ptr(), y_stride=out.stride(0))

    def gguf_rows(self, x, blocks, fmt: int, out, int8_activations: bool = False) -> None:
        """out [M, N] (rows of any stride, columns contiguous) = x [M, K] (float32,
        contiguous, 1-8 rows) @ the weight whose N rows of GGUF blocks of format ``fmt``
        (kvserve.model.gguf.linear.FORMAT_CODES) are ``blocks`` [N, row bytes] uint8,
        transposed. ``int8_activations``: x rounded to int8 per 32 values first and the
        products summed in integers (as llama.cpp does), where this build has such a
        kernel for the format; else in float."""
        if int8_activations and self.gguf_rows_int8(x, blocks, fmt, out):
            return
        failed = self._gguf_rows(**self._gguf_args(x, blocks, fmt, out))
        if failed:
            raise ValueError(f"gguf_rows: format {fmt} with K={x.shape[1]} and "
                             f"{x.shape[0]} rows is not one it computes (1-8 rows, whole blocks)")

    def gguf_rows_int8(self, x, blocks, fmt: int, out) -> bool:
        """As ``gguf_rows`` with int8 activations, for any number of rows (a prompt chunk
        too): True when computed, False where this build has no integer kernel for the
        format (the caller computes in float)."""
        status = self._gguf_rows_int8(**self._gguf_args(x, blocks, fmt, out))
        if status < 0:
            raise MemoryError("gguf_rows: no memory for the rows rounded to int8")
        return status == 0

    def gguf_dequantize(self, blocks, fmt: int, k: int):
        """float32 [N, k] of N rows of GGUF blocks of format ``fmt`` (uint8 [N, bytes])."""
        out = torch.empty((blocks.shape[0], k), dtype=torch.float32)
        if not (blocks.dtype == torch.uint8 and blocks.is_contiguous()) or self._gguf_dequantize(
                w=blocks.data_ptr(), n=blocks.shape[0], k=k, fmt=fmt, out=out.data_ptr()):
            raise ValueError(f"gguf_dequantize: format {fmt}, K={k} is not whole blocks "
                             "of a known format, or the blocks are not contiguous uint8")
        return out

    def gguf_dequantize_row(self, blocks, row: int, k: int, fmt: int):
        """float32 [k] of row ``row`` of GGUF blocks of format ``fmt`` (uint8 [N, bytes],
        runs of rows too): a token embedding's lookup, as the captured step makes it."""
        if not (blocks.dtype == torch.uint8 and blocks.is_contiguous()
                and 0 <= row < blocks.shape[0]):
            raise ValueError(f"gguf_dequantize_row takes contiguous uint8 blocks and a row "
                             f"below {blocks.shape[0]}; got {blocks.dtype}, row {row}")
        out = torch.empty(k, dtype=torch.float32)
        self._gguf_dequantize_row(w=blocks.data_ptr(), row=row, k=k, fmt=fmt,
                                  out=out.data_ptr())
        return out

    def gguf_repack_runs(self, blocks, kind: str, k: int, unpack: bool = False):
        """Q4_K, Q5_K, Q6_K or Q8_0 rows (``kind``; uint8 [N, k/256 * 144, 176 or 210;
        k/32 * 34]) as runs of rows (Q4_K_X4, Q5_K_X4, Q6_K_X4: four rows, uint8
        [N, k/256 * 148, 180 or 210], ``gguf_k_x4.h``, ``gguf_q6_k_x4.h``; Q8_0_X8: eight
        rows, the same bytes, ``gguf_q8_0_x8.h``), or back with ``unpack``; None where this
        build has no kernel for the runs (the rows stay as the file has them)."""
        if kind not in RUNS:
            raise ValueError(f"gguf_repack_runs takes {', '.join(RUNS)} rows, not {kind}")
        code, values, file_bytes, run_bytes, rows = RUNS[kind]
        width = k // values * (run_bytes if unpack else file_bytes)
        if not (blocks.dtype == torch.uint8 and blocks.is_contiguous() and blocks.dim() == 2
                and blocks.shape[1] == width):
            raise ValueError(f"gguf_repack_runs takes contiguous uint8 rows of {width} "
                             f"bytes for K={k}; got {blocks.dtype} {tuple(blocks.shape)}")
        out = torch.empty((blocks.shape[0], k // values * (file_bytes if unpack else run_bytes)),
                          dtype=torch.uint8)
        status = self._gguf_repack_runs(src=blocks.data_ptr(), n=blocks.shape[0], k=k,
                                        fmt=code, dst=out.data_ptr(), unpack=int(unpack))
        if status < 0:
            raise ValueError(f"gguf_repack_runs: {blocks.shape[0]} rows of K={k} are not "
                             f"whole runs of {rows} rows of whole {kind} blocks (K at most "
                             "16384)")
        return None if status else out

    def int4_rows(self, x, codes, scales, zeros, group: int, out) -> None:
        """out [M, N] (rows of any stride, columns contiguous) = x [M, K] (float32,
        contiguous, 1-8 rows) @ the 4-bit weight (``int4_linear.c``'s layout: codes
        [N, K/2] uint8, scales [N, K/group] float32, zeros [N, K/group] int8), transposed."""
        if not (x.dtype == out.dtype == scales.dtype == torch.float32 and x.is_contiguous()
                and codes.dtype == torch.uint8 and zeros.dtype == torch.int8
                and all(t.is_contiguous() for t in (codes, scales, zeros))
                and out.stride(1) == 1 and out.shape == (x.shape[0], codes.shape[0])):
            raise ValueError("int4_rows takes contiguous float32 x [M, K], codes [N, K/2] "
                             "uint8, float32 scales and int8 zeros [N, K/group], and float32 "
                             "out [M, N] with contiguous rows")
        if self._int4_rows(x=x.data_ptr(), m=x.shape[0], k=x.shape[1], codes=codes.data_ptr(),
                           scales=scales.data_ptr(), zeros=zeros.data_ptr(), group=group,
                           n=codes.shape[0], y=out.data_ptr(), y_stride=out.stride(0)):
            raise ValueError(f"int4_rows: group {group} with K={x.shape[1]} and {x.shape[0]} "
                             "rows is not one it computes (1-8 rows, groups of whole 32s)")

    def int4_dequantize(self, codes, scales, zeros, group: int):
        """float32 [N, K]: the 4-bit weight's values, (q - z) * s."""
        n, k = codes.shape[0], codes.shape[1] * 2
        out = torch.empty((n, k), dtype=torch.float32)
        if self._int4_dequantize(codes=codes.data_ptr(), scales=scales.data_ptr(),
                                 zeros=zeros.data_ptr(), group=group, n=n, k=k,
                                 out=out.data_ptr()):
            raise ValueError(f"int4_dequantize: group {group} does not divide K={k} in 32s")
        return out

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

    def quantize_rows(self, x, divisor: float = 127.0):
        """Per-row symmetric int8 of float32 x [R, C] (contiguous) -> (q int8, scale [R]),
        scale = max|row| / ``divisor`` (kvserve.model.quantization.quantize_rows)."""
        q = torch.empty(x.shape, dtype=torch.int8)
        scale = torch.empty(x.shape[0], dtype=torch.float32)
        self._quantize_rows(x=x.data_ptr(), q=q.data_ptr(), scale=scale.data_ptr(),
                            rows=x.shape[0], cols=x.shape[1], divisor=divisor)
        return q, scale

    def rescale_int32(self, acc, row_scale, col_scale, bias):
        """float32 (acc [R, C] int32 * row_scale[:, None]) * col_scale (+ bias)."""
        out = torch.empty(acc.shape, dtype=torch.float32)
        self._rescale_int32(acc=acc.data_ptr(), row_scale=row_scale.data_ptr(),
                            col_scale=col_scale.data_ptr(),
                            bias=0 if bias is None else bias.data_ptr(), out=out.data_ptr(),
                            rows=acc.shape[0], cols=acc.shape[1])
        return out

    def int8_matmul(self, x, w):
        """int32 [M, N] = x [M, K] int8 @ w [N, K] int8 transposed, summed exactly
        (``torch._int_mm(x, w.t())``'s values)."""
        if not (x.dtype == w.dtype == torch.int8 and x.is_contiguous() and w.is_contiguous()
                and x.dim() == w.dim() == 2 and x.shape[1] == w.shape[1]):
            raise ValueError("int8_matmul takes contiguous int8 x [M, K] and w [N, K]")
        acc = torch.empty((x.shape[0], w.shape[0]), dtype=torch.int32)
        if self._int8_matmul(x=x.data_ptr(), m=x.shape[0], k=x.shape[1], w=w.data_ptr(),
                             n=w.shape[0], acc=acc.data_ptr()):
            raise MemoryError("int8_matmul: no memory for the activations' -128 columns")
        return acc

    def int8_pack_runs(self, w):
        """An int8 weight w [N, K] in runs of eight rows (``int8_runs.c``), with its rows'
        sums: (runs [ceil(N / 8) * 8, K] int8, row_sums [N] int32), or None where this
        build has no kernel for the runs (no AVX-512 VNNI) or K is not one it takes."""
        if not (w.dtype == torch.int8 and w.is_contiguous() and w.dim() == 2):
            raise ValueError("int8_pack_runs takes a contiguous int8 weight [N, K]")
        n, k = w.shape
        runs = torch.empty((-(-n // 8) * 8, k), dtype=torch.int8)
        row_sums = torch.empty(n, dtype=torch.int32)
        if self._int8_pack_runs(w=w.data_ptr(), n=n, k=k, runs=runs.data_ptr(),
                                row_sums=row_sums.data_ptr()):
            return None
        return runs, row_sums

    def int8_runs_matmul(self, x, runs, row_sums):
        """int8_matmul's sums, from a weight's runs and row sums (``int8_pack_runs``)."""
        n = row_sums.shape[0]
        if not (x.dtype == runs.dtype == torch.int8 and x.is_contiguous() and x.dim() == 2
                and runs.is_contiguous() and runs.shape[1] == x.shape[1]
                and runs.shape[0] == -(-n // 8) * 8 and row_sums.dtype == torch.int32):
            raise ValueError("int8_runs_matmul takes contiguous int8 x [M, K] and the runs "
                             "and row sums int8_pack_runs made of a weight [N, K]")
        acc = torch.empty((x.shape[0], n), dtype=torch.int32)
        status = self._int8_runs_matmul(x=x.data_ptr(), m=x.shape[0], k=x.shape[1],
                                        runs=runs.data_ptr(), row_sums=row_sums.data_ptr(),
                                        n=n, acc=acc.data_ptr())
        if status < 0:
            raise MemoryError("int8_runs_matmul: no memory for the activations")
        if status:
            raise ValueError("int8_runs_matmul: this build has no kernel for the runs")
        return acc

    def bf16_pack_runs(self, w):
        """A bfloat16 weight w [N, K] in runs of sixteen rows (``bf16_runs.c``):
        [ceil(N / 16) * 16, K] bfloat16, or None where this build has no kernel for the
        runs (no AVX512-BF16) or K is odd."""
        if not (w.dtype == torch.bfloat16 and w.is_contiguous() and w.dim() == 2):
            raise ValueError("bf16_pack_runs takes a contiguous bfloat16 weight [N, K]")
        n, k = w.shape
        runs = torch.empty((-(-n // 16) * 16, k), dtype=torch.bfloat16)
        if self._bf16_pack_runs(w=w.data_ptr(), n=n, k=k, runs=runs.data_ptr()):
            return None
        return runs

    def bf16_runs_matmul(self, x, runs, n: int, bias=None):
        """bfloat16 [M, n] = x [M, K] bfloat16 @ the weight of ``runs`` (its first n rows,
        ``bf16_pack_runs``) transposed, + bias (float32 [n]), summed in float32."""
        if not (x.dtype == runs.dtype == torch.bfloat16 and x.is_contiguous() and x.dim() == 2
                and runs.is_contiguous() and runs.shape[1] == x.shape[1]
                and runs.shape[0] == -(-n // 16) * 16
                and (bias is None or (bias.dtype == torch.float32 and bias.shape == (n,)))):
            raise ValueError("bf16_runs_matmul takes contiguous bfloat16 x [M, K], the runs "
                             "bf16_pack_runs made of a weight [n, K] and a float32 bias [n]")
        y = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
        if self._bf16_runs_matmul(x=x.data_ptr(), m=x.shape[0], k=x.shape[1],
                                  runs=runs.data_ptr(), n=n,
                                  bias=0 if bias is None else bias.data_ptr(),
                                  y=y.data_ptr(), y_stride=n):
            raise ValueError("bf16_runs_matmul: this build has no kernel for the runs")
        return y


@functools.cache
def load_kernels() -> Kernels:
    """The process's kernels, built on first call."""
    return Kernels()

"""The weight formats' wrappers of :class:`~kvserve.kernels.Kernels`: GGUF blocks, 4-bit
groups, int8 (quantize, rescale, sums) and the runs of rows the few-row kernels read
(``int8_runs.c``, ``bf16_runs.c``). A mixin: the bound C functions (``self._gguf_rows``,
...) are set by ``Kernels.__init__``."""
from __future__ import annotations

import torch

# the formats kept in runs of rows: gguf_linear.c's code for the file's format, the values
# of its block, its bytes a block of a row, the runs' bytes a block of a row, and the rows
# of a run
RUNS = {"Q4_K": (2, 256, 144, 148, 4), "Q5_K": (3, 256, 176, 180, 4),
        "Q6_K": (4, 256, 210, 210, 4), "Q8_0": (0, 32, 34, 34, 8), "BF16": (5, 32, 64, 64, 16)}



class WeightFormatKernels:
    """GGUF, 4-bit and int8 wrappers, and the runs of rows (see the module)."""

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
        """Q4_K, Q5_K, Q6_K, Q8_0 or BF16 rows (``kind``; uint8 [N, k/256 * 144, 176 or
        210; k/32 * 34; 2k]) as runs of rows (Q4_K_X4, Q5_K_X4, Q6_K_X4: four rows, uint8
        [N, k/256 * 148, 180 or 210], ``gguf_k_x4.h``, ``gguf_q6_k_x4.h``; Q8_0_X8: eight
        rows, the same bytes, ``gguf_q8_0_x8.h``; BF16_X16: sixteen rows, the same bytes,
        ``bf16_runs.c``), or back with ``unpack``; None where this build has no kernel for
        the runs (the rows stay as the file has them)."""
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

    @staticmethod
    def unpack_row_runs(runs, n: int, run_rows: int, group: int):
        """The plain [n, K] weight of ``runs`` [rows, K] (``row_runs.h``: runs of
        ``run_rows`` rows, each row's values ``group`` at a time)."""
        k = runs.shape[1]
        plain = runs.reshape(-1, k // group, run_rows, group).transpose(1, 2)
        return plain.reshape(-1, k)[:n].contiguous()

"""GEMM kernels generated at start for every batch size a decode step can have.

oneDNN generates (JIT-compiles) a kernel for each GEMM shape the first time it meets it
and keeps it in a cache. A decode step's GEMMs have as many rows as the step has
sequences, so a server or an offline run keeps meeting new row counts as requests
arrive and finish, and a step that meets a row count for the first time pays for the
kernel's generation. Running each distinct linear shape once at every row count up to
``max_num_seqs`` at start moves that cost out of the steps — the CPU counterpart of
capturing a CUDA graph per batch size.

Both caches involved (oneDNN's primitive cache and the one of ideep, torch's oneDNN
wrapper) hold 1024 kernels unless their environment variables say otherwise; the
warm-up fills at most that much less ``CACHE_HEADROOM``, which is left for the prompt
steps' shapes, so that it does not evict what it generated.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from kvserve.worker.tuning.row_padding import packed_linears

DEFAULT_CACHE_CAPACITY = 1024
CACHE_HEADROOM = 256
CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def kernel_cache_capacity(environ: dict[str, str] | None = None) -> int:
    """The smaller of the two kernel caches' capacities (their defaults: 1024)."""
    environ = os.environ if environ is None else environ
    sizes = []
    for name in CAPACITY_VARIABLES:
        try:
            sizes.append(int(environ.get(name, DEFAULT_CACHE_CAPACITY)))
        except ValueError:
            sizes.append(DEFAULT_CACHE_CAPACITY)
    return min(sizes)


def distinct_shapes(model: nn.Module) -> list[nn.Module]:
    """One packed linear layer per distinct GEMM (in/out features, dtype, bias or not)."""
    return one_per_shape(packed_linears(model))


def one_per_shape(linears: list) -> list:
    """The first of the packed ``linears`` with each GEMM shape (in/out features, dtype,
    bias or not)."""
    shapes: dict[tuple, nn.Module] = {}
    for linear in linears:
        key = (linear.in_features, linear.out_features, linear.method.packed_weight.dtype,
               linear.bias is not None)
        shapes.setdefault(key, linear)
    return list(shapes.values())


def rows_to_warm(max_rows: int, num_shapes: int, capacity: int) -> int:
    """How many row counts (1..n) to warm: up to ``max_rows``, as far as the caches hold
    them next to ``CACHE_HEADROOM`` other kernels."""
    if num_shapes == 0:
        return 0
    return max(0, min(max_rows, (capacity - CACHE_HEADROOM) // num_shapes))


@torch.inference_mode()
def warm_gemm_kernels(model: nn.Module, max_rows: int) -> tuple[int, int]:
    """Run every distinct packed linear shape of ``model`` once at each row count
    1..n (n: ``max_rows``, or less where the kernel caches would not hold them all), on
    zero inputs; the layers keep no state from it. Returns (shapes, n)."""
    linears = distinct_shapes(model)
    rows = rows_to_warm(max_rows, len(linears), kernel_cache_capacity())
    zeros: dict[tuple, torch.Tensor] = {}  # one input per (width, dtype), sliced per count
    pairs = []
    for linear in linears:
        key = (linear.in_features, linear.method.packed_weight.dtype)
        if key not in zeros:
            zeros[key] = torch.zeros(rows, key[0], dtype=key[1])
        pairs.append((linear, zeros[key]))
    for count in range(1, rows + 1):
        for linear, x in pairs:
            if not linear.method.panel_min_rows <= count <= linear.method.panel_max_rows:
                linear(x[:count])  # the native panel GEMM has no kernel to generate
    return len(linears), rows

"""Few-row GEMMs on the dense weight where that beats oneDNN's packed one.

oneDNN's packed GEMM streams large weights well at every row count, but each call has a
fixed cost that a small weight (one that stays in the cache, as a draft model's do)
does not repay: there the plain GEMV/GEMM on the dense weight, which the layer keeps
anyway, is faster at one or a few rows. Which layers gain is the CPU's and the kernel
libraries' business, so the worker measures it at start on the model's own layers, one
pass over all of them per round (each weight as cold as in a step), and a layer takes
the dense path for the row counts where it was clearly faster. This module measures and
chooses; the layer's ``forward`` applies ``dense_max_rows``.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from kvserve.worker.row_padding import packed_linears

DENSE_ROWS = (1, 2, 3, 4)  # row counts tried on the dense weight
REQUIRED_GAIN = 0.10       # the dense path must be at least this much faster


@torch.inference_mode()
def _layer_times(linears: list, rows: int, dense: bool, rounds: int) -> list[float]:
    """Median seconds of each layer's call at ``rows`` rows, timed one by one inside
    full passes."""
    gen = torch.Generator().manual_seed(0)
    inputs = {m.in_features: torch.randn(rows, m.in_features, generator=gen,
                                         dtype=m.weight.dtype) for m in linears}
    samples: list[list[float]] = [[] for _ in linears]
    for _ in range(rounds + 1):  # the first round only warms up
        for i, m in enumerate(linears):
            m.dense_max_rows = rows if dense else 0
            start = time.perf_counter()
            m(inputs[m.in_features])
            samples[i].append(time.perf_counter() - start)
    return [statistics.median(s[1:]) for s in samples]


def choose_dense_rows(model: nn.Module, rounds: int = 7) -> dict[int, int]:
    """Set each packed layer's ``dense_max_rows``: the largest count in DENSE_ROWS up to
    which the dense path was clearly faster at every count. Returns how many layers
    took each value (0: none)."""
    linears = packed_linears(model)
    chosen = [0] * len(linears)
    open_ = [True] * len(linears)
    for rows in DENSE_ROWS:
        packed = _layer_times(linears, rows, False, rounds)
        dense = _layer_times(linears, rows, True, rounds)
        for i in range(len(linears)):
            if open_[i] and dense[i] <= (1 - REQUIRED_GAIN) * packed[i]:
                chosen[i] = rows
            else:
                open_[i] = False
        if not any(open_):
            break
    counts: dict[int, int] = {}
    for m, rows in zip(linears, chosen):
        m.dense_max_rows = rows
        counts[rows] = counts.get(rows, 0) + 1
    return counts

"""Small GEMMs run padded to the row count the CPU's GEMM kernels stream weights fastest at.

A decode step with a few sequences is a pass of few-row GEMMs over every weight of the
model, bound by memory. How fast oneDNN streams the weights depends on the kernel it
picks for the row count, and more rows is not always slower: on some CPUs a 6-row pass
beats a 1-row one. Which count wins is the kernel library's and
the CPU's business, so the worker measures it at start on the model's own layers, not
assumed: the fastest row count of a cold pass is kept when it beats the smaller counts
clearly. This module only measures and chooses; the worker applies the choice through
:func:`kvserve.model.execution.configure_layers`.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from kvserve.model.layers import Linear

TUNE_ROWS = 8         # row counts 1..TUNE_ROWS are timed at start
REQUIRED_GAIN = 0.05  # padding is kept only when the pass is at least this much faster


def named_packed_linears(model: nn.Module) -> list[tuple[str, Linear]]:
    """The linear layers with a oneDNN-packed weight, with their names in the model."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, Linear) and getattr(m.method, "packed_weight", None) is not None]


def packed_linears(model: nn.Module) -> list[Linear]:
    return [m for _, m in named_packed_linears(model)]


@torch.inference_mode()
def time_passes(linears: list[Linear], row_counts: list[int], rounds: int) -> dict[int, float]:
    """Median seconds of one pass through ``linears`` at each row count, as the layers
    are configured (unpadded, for a true measurement). The counts are interleaved within
    each round so that a slow minute of the machine slows all alike; a pass through a
    model larger than the cache finds its weights cold, as a step does."""
    gen = torch.Generator().manual_seed(0)  # leaves the global generator alone
    inputs = {m.in_features: torch.randn(max(row_counts), m.in_features, generator=gen,
                                         dtype=m.method.packed_weight.dtype) for m in linears}
    times: dict[int, list[float]] = {rows: [] for rows in row_counts}
    for _ in range(rounds + 1):  # the first round only warms up
        for rows in row_counts:
            start = time.perf_counter()
            for m in linears:
                m(inputs[m.in_features][:rows])
            times[rows].append(time.perf_counter() - start)
    return {rows: statistics.median(ts[1:]) for rows, ts in times.items()}


def choose_min_rows(pass_times: dict[int, float], required_gain: float = REQUIRED_GAIN) -> int:
    """The row count whose pass is fastest, if padding every smaller count to it saves at
    least ``required_gain`` of their mean time; else 1 (no padding)."""
    best = min(pass_times, key=lambda rows: (pass_times[rows], rows))
    smaller = [t for rows, t in pass_times.items() if rows < best]
    if smaller and pass_times[best] <= (1 - required_gain) * statistics.mean(smaller):
        return best
    return 1


def measure_min_rows(model: nn.Module, rounds: int = 5) -> tuple[int, dict[int, float]]:
    """The padding target for the model's packed linear layers, which must be unpadded
    now; returns (the target, the pass times it was chosen from), (1, {}) without packed
    layers."""
    linears = packed_linears(model)
    if not linears:
        return 1, {}
    if any(m.method.min_rows != 1 for m in linears):
        raise ValueError("measure_min_rows needs unpadded layers (linear_min_rows 1)")
    pass_times = time_passes(linears, list(range(1, TUNE_ROWS + 1)), rounds)
    return choose_min_rows(pass_times), pass_times

"""Few-row GEMMs off oneDNN's packed weight where that is faster: torch's own dense
GEMM/GEMV, or the native few-row GEMV (over the layer's panels, ``kernels/gemm.c``, or
its dense weight, ``kernels/gemv.c``).

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


DENSE_ROWS = (1, 2, 3, 4)  # row counts tried on the dense weight
REQUIRED_GAIN = 0.10       # the dense path must be at least this much faster


PATHS = ("packed", "dense", "native")


def _use(m, path: str, rows: int, native) -> None:
    """Put layer ``m``'s GEMMs of up to ``rows`` rows on ``path``; ``native``: the
    kernels (kvserve.kernels.Kernels)."""
    if path == "native" and m.weight.dtype != torch.float32:
        path = "packed"  # the kernel is float32's
    if path == "dense":
        m.method.restore_dense_weight(m)  # where the panels had let it go
    m.method.dense_max_rows = rows if path == "dense" else 0
    m.method.native_max_rows = rows if path == "native" else 0
    m.method.native = native if path == "native" else None


@torch.inference_mode()
def _layer_times(linears: list, rows: int, path: str, rounds: int, native) -> list[float]:
    """Median seconds of each layer's call at ``rows`` rows on ``path``, timed one by one
    inside full passes."""
    gen = torch.Generator().manual_seed(0)
    inputs = {m.in_features: torch.randn(rows, m.in_features, generator=gen,
                                         dtype=m.weight.dtype) for m in linears}
    samples: list[list[float]] = [[] for _ in linears]
    for _ in range(rounds + 1):  # the first round only warms up
        for i, m in enumerate(linears):
            _use(m, path, rows, native)
            start = time.perf_counter()
            m(inputs[m.in_features])
            samples[i].append(time.perf_counter() - start)
    return [statistics.median(s[1:]) for s in samples]


def choose_layer_paths(linears: list, rounds: int = 7, native=None) -> list[str]:
    """Give each of the packed ``linears``, for 1..r rows, the path that was clearly
    faster than the packed GEMM (by REQUIRED_GAIN) and the fastest at every count up to
    r: the dense weight through torch, or ``native`` (the kernels' few-row GEMV, float32
    layers only). Returns each layer's path as "packed" or "path<=r"."""
    paths = ["dense"] + (["native"] if native is not None else [])
    chosen: list[tuple[str, int]] = [("packed", 0)] * len(linears)
    open_ = [True] * len(linears)
    for rows in DENSE_ROWS:
        packed = _layer_times(linears, rows, "packed", rounds, native)
        times = {p: _layer_times(linears, rows, p, rounds, native) for p in paths}
        for i, m in enumerate(linears):
            if not open_[i]:
                continue
            usable = [p for p in paths if p != "native" or m.weight.dtype == torch.float32]
            best = min(usable, key=lambda p: times[p][i])
            same = chosen[i][0] in ("packed", best)
            if same and times[best][i] <= (1 - REQUIRED_GAIN) * packed[i]:
                chosen[i] = (best, rows)
            else:
                open_[i] = False
        if not any(open_):
            break
    named = [f"{path}<={rows}" if rows else "packed" for path, rows in chosen]
    apply_layer_paths(linears, named, native)
    return named


def apply_layer_paths(linears: list, paths: list[str], native) -> None:
    """Put each layer on its path ("packed" or "path<=r", as :func:`choose_layer_paths`
    names them) without measuring."""
    for m, named in zip(linears, paths, strict=True):
        path, _, rows = named.partition("<=")
        if path not in PATHS or (path != "packed") != bool(rows):
            raise ValueError(f"a layer's few-row path is packed, dense<=N or native<=N, "
                             f"got {named!r}")
        _use(m, path, int(rows or 0), native)


def path_counts(paths: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in paths:
        counts[path] = counts.get(path, 0) + 1
    return counts

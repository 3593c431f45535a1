"""Which copy of the weights the native few-row GEMV reads: the panels or the dense
weight, measured at start.

At one to a few rows a linear layer is a stream over its weight, and how fast a core
streams depends on how it is read. Over the panels ([n/16][k][16]) each thread reads one
contiguous run; over the dense [n][k] weight the GEMV reads a few weight rows side by
side, several streams at once (``kernels/gemv.c``). Some CPUs keep more reads in flight
with one stream and its prefetches, others with several: on AVX2 Zen 3 the panels were
faster, on an AVX-512 Intel Xeon the dense weight, by a little. So the worker times one
pass over every layer on each copy, alternating, and keeps the panels unless the dense
weight was clearly faster. One choice for the whole model: the captured step's plan
reads one kind of weight (``kernels/decode_step.c``).

The copy the GEMV does not read may still serve the panel GEMM (the panels) or torch's
few-row GEMMs (the dense weight); what nothing reads goes at the end of start-up
(``panel_gemm.release_unread_copies``).
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from kvserve.worker.tuning.panel_gemm import panel_linears

ROWS = (1, 4)       # the GEMV's row counts timed: a lone stream, and a few at once
ROUNDS = 4          # passes over the model on each copy at each count (after a warm one)
REQUIRED_GAIN = 0.03  # the dense weight must be this much faster, over both counts


@torch.inference_mode()
def measure_gemv_weights(linears: list, kernels, rows: tuple[int, ...] = ROWS,
                         rounds: int = ROUNDS) -> dict[int, tuple[float, float]]:
    """{rows: (dense s, panels s)}: the median of ``rounds`` passes over ``linears`` (in
    model order, each weight cold as in a step) on each copy, the copies alternating
    first from round to round."""
    gen = torch.Generator().manual_seed(0)
    times: dict[int, tuple[float, float]] = {}
    for n in rows:
        xs = {m.in_features: torch.randn(n, m.in_features, generator=gen) for m in linears}
        samples: dict[bool, list[float]] = {False: [], True: []}
        for r in range(rounds + 1):  # the first round only warms up
            for panels in ((False, True) if r % 2 == 0 else (True, False)):
                start = time.perf_counter()
                for m in linears:
                    if panels:
                        kernels.gemv_panels(xs[m.in_features], m.method.panel_weight, m.bias)
                    else:
                        kernels.gemv_rows(xs[m.in_features], m.weight, m.bias)
                if r:
                    samples[panels].append(time.perf_counter() - start)
        times[n] = (statistics.median(samples[False]), statistics.median(samples[True]))
    return times


def dense_clearly_faster(times: dict[int, tuple[float, float]],
                         gain: float = REQUIRED_GAIN) -> bool:
    dense = sum(d for d, _ in times.values())
    panels = sum(p for _, p in times.values())
    return dense <= (1 - gain) * panels


def choose_gemv_weights(model: nn.Module, kernels) -> dict[int, tuple[float, float]]:
    """Time both copies on the model's layers with panels and set their
    ``gemv_reads_panels``; returns the times ({} where no layer has panels, or one
    lacks its dense weight)."""
    linears = [m for m in panel_linears(model) if m.method.panel_weight is not None]
    if not linears or any(m.weight.is_meta for m in linears):
        return {}
    times = measure_gemv_weights(linears, kernels)
    on_panels = not dense_clearly_faster(times)
    for m in linears:
        m.method.gemv_reads_panels = on_panels
    return times


def set_gemv_weights(model: nn.Module, on_panels: bool) -> None:
    """The GEMV of every layer with panels reads them (``on_panels``) or the dense
    weight, without measuring."""
    for m in panel_linears(model):
        if m.method.panel_weight is not None:
            m.method.gemv_reads_panels = on_panels

"""Linear layers of more than a few rows on the native panel GEMM (``kernels/gemm.c``)
where it makes steps faster than oneDNN's packed GEMM does, as measured at start.

A decode step of many requests, or a step with prompt chunks, runs its GEMMs at tens to
thousands of rows: bound by the FMAs, not by streaming the weight. How close oneDNN's
kernels come to the FMA peak there, and whether the native 6 x 16 register tile comes
closer, is the CPU's business, so the worker measures. It times whole decode steps up a
ladder of row counts with the layers on each path, not the GEMMs alone: in a step the
GEMMs alternate with the native kernels (norms, rotary, attention), and on the machine
the kernel was built on the two tied as lone GEMMs from 128 rows up while whole steps
ran clearly faster on the panel GEMM. The panel GEMM gets the
rows up to the largest count it won, having won every count below too: clearly faster at
the smallest, not slower at each larger one. Where it won the whole ladder it takes
every larger count as well (a prompt chunk's thousands of rows), unless lone GEMMs at a
prompt step's rows, one per decoder layer shape, ran slower on it than on oneDNN by more
than PROMPT_TOLERANCE: a whole step that large would cost seconds of start-up to time,
and on some CPUs oneDNN's blocking for thousands of rows beats the panel GEMM's.

The panels are packed at load, since the few-row GEMV and the captured step read them
too (one stream per thread, where the dense weight is several); where nothing reads
them at the end of start-up, they go, and where they serve every few-row GEMM of a
layer, its dense weight goes instead (a model then keeps two copies of its float32
linear weights, not three: the panels and oneDNN's).

The layers' ``forward`` applies ``panel_max_rows``; rows below ``panel_min_rows`` stay
with the few-row paths (``small_gemm``, ``row_padding``, the captured step).
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from kvserve.kernels import PANEL_COLUMNS
from kvserve.worker.tuning.gemm_warmup import one_per_shape
from kvserve.worker.huge_pages import HugePageBuffer, aligned_size
from kvserve.worker.tuning.row_padding import packed_linears

ROW_LADDER = (16, 64, 128)  # decode steps of this many requests are timed
REQUIRED_GAIN = 0.05  # the panel GEMM's step must be at least this much faster at the
# smallest count; at each larger one, not slower: the count below already showed it
# ahead, and the same 5 % bar on steps this noisy left larger counts on oneDNN where
# whole runs were faster on the panel GEMM
EXTEND_GAIN = 0.0
ROUNDS = 3
ALL_ROWS = 2**62  # panel_max_rows when the panel GEMM won the whole ladder
PROMPT_ROWS = 2048  # at most this many rows in the prompt-size check
PROMPT_TOLERANCE = 0.03  # the panel GEMM keeps prompt steps unless this much slower there

StepTimer = Callable[[list[int]], dict[int, float]]  # row counts -> seconds of one step each


def panel_linears(model: nn.Module) -> list:
    """The packed float32 layers whose output columns fill whole panels."""
    return [m for m in packed_linears(model)
            if m.weight.dtype == torch.float32 and m.out_features % PANEL_COLUMNS == 0]


def measure_panel_rows(linears: list, time_steps: StepTimer, rounds: int = ROUNDS,
                       ladder: tuple[int, ...] = ROW_LADDER) -> dict[int, tuple[float, float]]:
    """{rows: (oneDNN s, panel s)}: at each ladder count, ``rounds`` pairs of decode
    steps, one with the layers on each path, and the pair whose ratio is the median of
    the rounds'. On a shared machine a burst of other work slows whatever runs during
    it, sometimes for several steps in a row: a pair's two steps are adjacent, so a
    burst mostly slows both, and the median pair is one no burst decided (the fastest
    step of each path would let a burst over one path's steps decide).
    Counts go up the ladder until one the panel GEMM lost (see chosen_rows).
    oneDNN's kernels for the counts are generated first, outside the timing. The layers
    carry their panels; they are left on oneDNN."""
    _warm_onednn(linears, ladder)
    times: dict[int, tuple[float, float]] = {}
    try:
        for n in ladder:
            pairs = []
            for _ in range(rounds):
                pair = []
                for panel in (False, True):
                    for m in linears:
                        m.method.panel_max_rows = ALL_ROWS if panel else 0
                    step = time_steps([n])
                    if n not in step:
                        return times  # no room for such a step
                    pair.append(step[n])
                pairs.append(tuple(pair))
            pairs.sort(key=lambda pair: pair[1] / pair[0])
            times[n] = pairs[(len(pairs) - 1) // 2]
            if chosen_rows(times, ladder=ladder) not in (n, ALL_ROWS):  # n was lost
                break
    finally:
        for m in linears:
            m.method.panel_max_rows = 0
    return times


@torch.inference_mode()
def _warm_onednn(linears: list, counts: tuple[int, ...]) -> None:
    """One oneDNN GEMM of each distinct layer shape at each count (it generates a
    kernel the first time it meets a shape)."""
    for m in one_per_shape(linears):
        m.method.panel_max_rows = 0
        for n in counts:
            m(torch.zeros(n, m.in_features))


def clearly_faster(onednn: float, panel: float, gain: float = REQUIRED_GAIN) -> bool:
    return panel <= (1 - gain) * onednn


def chosen_rows(times: dict[int, tuple[float, float]], gain: float = REQUIRED_GAIN,
                ladder: tuple[int, ...] = ROW_LADDER, extend_gain: float = EXTEND_GAIN) -> int:
    """The largest measured row count up to which the panel GEMM won: faster than oneDNN
    by ``gain`` at the smallest count, by ``extend_gain`` at each larger one; 0 when the
    smallest was not won; ALL_ROWS when every count of the whole ladder was."""
    chosen = 0
    for rows in sorted(times):
        if not clearly_faster(*times[rows], gain if chosen == 0 else extend_gain):
            return chosen
        chosen = rows
    return ALL_ROWS if set(ladder) <= set(times) else chosen


def pack_panel_weights(model: nn.Module, kernels, huge_pages: bool) -> int:
    """Give every eligible layer that has none its weight packed in panels. Where
    ``huge_pages``, the panels go into one huge-page buffer of their own and the dense
    weights (but one another module shares) into another: each copy can then be let go
    whole, and the GEMV's choice between them (worker/gemv_weights.py) times both on the
    pages they keep. Returns the bytes packed."""
    linears = [m for m in panel_linears(model) if m.method.panel_weight is None]
    sizes = [m.weight.numel() * m.weight.element_size() for m in linears]
    if huge_pages and linears:
        panels = HugePageBuffer(sum(aligned_size(n) for n in sizes))
        shared = shared_parameter_ids(model)
        own = [m for m in linears if id(m.weight) not in shared]
        dense = HugePageBuffer(sum(aligned_size(m.weight.numel() * 4) for m in own))
        with torch.no_grad():
            for m in own:
                m.weight.data = dense.take(tuple(m.weight.shape), torch.float32).copy_(m.weight)
    for m in linears:
        shape = (m.out_features // PANEL_COLUMNS, m.in_features, PANEL_COLUMNS)
        m.method.panel_weight = kernels.pack_panels(
            m.weight, panels.take(shape, torch.float32) if huge_pages else None)
    return sum(sizes)


def shared_parameter_ids(model: nn.Module) -> set[int]:
    """ids of the parameters that more than one module holds (a tied LM head's
    embeddings)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (shared if id(p) in seen else seen).add(id(p))
    return shared


@torch.inference_mode()
def time_prompt_gemms(linears: list, rows: int, rounds: int = ROUNDS) -> tuple[float, float]:
    """(oneDNN s, panel s): the fastest of ``rounds`` passes, the paths alternating
    first, of one GEMM of ``rows`` rows per decoder-layer shape, weighted by how many
    layers have it. A shape only one layer has (the LM head) is left out: a prompt step
    runs it at the prompts' last rows only. (0, 0) when no shape is repeated."""
    by_shape: dict[tuple[int, int], list] = {}
    for m in linears:
        by_shape.setdefault((m.in_features, m.out_features), []).append(m)
    timed = [(group[0], len(group)) for group in by_shape.values() if len(group) > 1]
    if not timed:
        return 0.0, 0.0
    inputs = [torch.randn(rows, m.in_features) for m, _ in timed]
    samples: dict[bool, list[float]] = {False: [], True: []}
    try:
        for r in range(rounds):
            for panel in ((False, True) if r % 2 == 0 else (True, False)):
                total = 0.0
                for (m, count), x in zip(timed, inputs):
                    m.method.panel_max_rows = ALL_ROWS if panel else 0
                    m(x)  # oneDNN generates its kernel for the count on first use
                    start = time.perf_counter()
                    m(x)
                    total += count * (time.perf_counter() - start)
                samples[panel].append(total)
    finally:
        for m, _ in timed:
            m.method.panel_max_rows = 0
    return min(samples[False]), min(samples[True])


def choose_panel_rows(model: nn.Module, kernels, time_steps: StepTimer,
                      prompt_rows: int = PROMPT_ROWS
                      ) -> tuple[int, dict[int, tuple[float, float]]]:
    """Measure and set the panel GEMM's rows on every layer that has panels. Returns
    (panel_max_rows, the measured times: decode steps by rows, and where the ladder was
    won, lone GEMMs at ``prompt_rows`` (at most PROMPT_ROWS))."""
    linears = [m for m in panel_linears(model) if m.method.panel_weight is not None]
    if not linears:
        return 0, {}
    for m in linears:
        m.method.panel_gemm = kernels.gemm_panels
    times = measure_panel_rows(linears, time_steps)
    rows = chosen_rows(times)
    top, prompt_rows = max(times, default=0), min(prompt_rows, PROMPT_ROWS)
    if rows == ALL_ROWS and prompt_rows > top:
        onednn, panel = time_prompt_gemms(linears, prompt_rows)
        if onednn:
            times[prompt_rows] = (onednn, panel)
            if panel > (1 + PROMPT_TOLERANCE) * onednn:
                rows = top
    set_panel_rows(model, kernels, rows)
    return rows, times


def set_panel_rows(model: nn.Module, kernels, rows: int) -> int:
    """The panel GEMM for up to ``rows`` rows on every layer that has panels (0: none;
    ALL_ROWS or more: every count), without measuring. Returns the rows set."""
    rows = min(rows, ALL_ROWS)
    for m in panel_linears(model):
        if m.method.panel_weight is not None:
            m.method.panel_max_rows = rows
            m.method.panel_gemm = kernels.gemm_panels if rows else None
    return rows


def release_unused_panels(model: nn.Module) -> int:
    """Let every layer's panels go when no layer reads them, neither in its GEMM nor in
    its GEMV (the caller knows the captured step does not either); returns the bytes
    released. All or none: on huge pages they share one buffer."""
    linears = [m for m in panel_linears(model) if m.method.panel_weight is not None]
    if any(m.method.panel_max_rows or (m.method.native_max_rows and m.method.gemv_reads_panels)
           for m in linears):
        return 0
    released = 0
    for m in linears:
        released += m.method.panel_weight.numel() * m.method.panel_weight.element_size()
        m.method.panel_weight = None
    return released


def release_dense_weights(model: nn.Module) -> int:
    """Let go of the dense weight of every layer whose panels or bf16 runs serve all its
    few-row GEMMs (the caller knows the captured step reads the panels too, if it runs),
    except a weight another module shares (a tied LM head's embeddings). Returns the
    bytes."""
    shared = shared_parameter_ids(model)
    return sum(m.method.release_dense_weight(m) for m in packed_linears(model)
               if id(m.weight) not in shared)


def release_unread_copies(model: nn.Module, captured_reads: str | None) -> tuple[int, int]:
    """The end of start-up: the panels go if nothing reads them, then each dense weight
    that nothing reads any more. ``captured_reads``: which weights the captured step's
    plan holds ("panels" or "dense"; None: no captured step). Returns the bytes of
    panels and of dense weights let go."""
    panels = release_unused_panels(model) if captured_reads != "panels" else 0
    dense = release_dense_weights(model) if captured_reads != "dense" else 0
    return panels, dense

"""``kvserve bench captured``: the captured step against eager (``--enforce-eager``).

One engine, rounds alternating between its captured step (the row counts it chose at
start) and eager (the captured step switched off, every step run layer by layer as with
``--enforce-eager``). Each round decodes 1, 2, 4 and 8 requests at once and times the
engine's decode steps. A captured single-stream step's linear layers and attention are
timed by the step itself, in the timed steps; what remains of those steps is the time
outside them. Warm-up rounds of both modes go first, and the timed ones run with the
step profiler off. A pass with the step profiler on every step splits a step of each
mode into linear layers, attention and the rest (eager's parts are timed by module
hooks, which add to them and to the step).

The streaming-read floor is the weights' bytes over the bandwidth of a large ``sum`` (on
huge pages and off, the faster), measured in every round: the best of them, since a
floor is the least a step can take and a busy neighbour only makes a measurement
slower. After it, each round times the native GEMV's pass over all the linear weights
at 1, 2, 4 and 8 rows, as a share of that round's streaming read. So that a step and
its floor are also measured at one moment, a last pass decodes a single stream in each
mode with every step followed by a timed streaming read of the weights' bytes, from the
memory the weights are on. The engine's start is timed too. Every ratio is the median
of ratios each taken at one moment (kvserve.bench.instruments.paired).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

from kvserve.bench.instruments.decode import concurrent_decode_steps
from kvserve.bench.instruments.paired import describe_ratio, paired_ratio, ratio_cell
from kvserve.bench.workloads.definitions import BenchRequest
from kvserve.worker import compute_thread

CONCURRENCY = (1, 2, 4, 8)
PROMPT_TOKENS = 128
NEW_TOKENS = 64
MODES = ("eager", "captured")


class _PartTimes:
    """Takes the captured step's own part timings, as the step profiler would, without
    the profiler's per-step hooks."""

    active = True

    def __init__(self) -> None:
        self.seconds = {"linear": 0.0, "attention": 0.0}

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds


def _profiled_split(engine, prompt: list[int], tag: str) -> dict[str, float]:
    """One request's decode with every step profiled: ms a step by part, and of the
    engine's whole step ("step") over the same steps."""
    worker = engine.worker
    marks = []
    worker.profiler.set_interval(1)
    try:
        steps = concurrent_decode_steps(engine, [prompt], tag, NEW_TOKENS,
                                        lambda: marks.append(worker.step_time_stats()))
    finally:
        worker.profiler.set_interval(0)
    before, after = marks[0], worker.step_time_stats()
    n = after.profiled_steps - before.profiled_steps
    if n != len(steps):  # the parts and "step" must be of the same steps
        raise RuntimeError(f"{n} of {len(steps)} decode steps were profiled")
    split = {part: 1000 * (after.by_part()[part] - before.by_part()[part]) / n
             for part in after.by_part()}
    return {**split, "step": 1000 * sum(steps) / len(steps)}


GEMV_ROWS = (1, 2, 4, 8)


def gemv_pass_bandwidth(model, kernels, passes: int = 5) -> dict[int, float]:
    """GB/s of the native GEMV's passes over every linear layer of the model (in step
    order, each weight cold as in a step) at each of GEMV_ROWS rows: the median pass.
    Each layer is read as the captured step reads it: its panels where its GEMV reads them."""
    import torch

    from kvserve.worker.tuning.row_padding import packed_linears

    layers = [m for m in packed_linears(model) if m.weight.dtype == torch.float32]
    gemvs = [(kernels.gemv_panels, m.method.panel_weight) if m.method.gemv_on_panels
             else (kernels.gemv_rows, m.weight) for m in layers]
    total = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    out = {}
    with torch.inference_mode():
        for rows in GEMV_ROWS:
            xs = {k: torch.randn(rows, k) for k in {m.in_features for m in layers}}
            times = []
            for _ in range(passes + 1):  # the first only warms up
                begin = time.perf_counter()
                for m, (gemv, weight) in zip(layers, gemvs):
                    gemv(xs[m.in_features], weight)
                times.append(time.perf_counter() - begin)
            out[rows] = total / statistics.median(times[1:]) / 1e9
    return out


def _paired_reads(engine, prompt: list[int], tag: str, weight_bytes: int
                  ) -> list[tuple[float, float]]:
    """One request's decode, each step followed by a timed streaming read (``sum``) of
    as many bytes as the step's weights, from the memory they are on: (step s, read s)
    pairs, each of two moments close enough for this machine's speed to be alike."""
    import torch

    from kvserve import SamplingParams
    from kvserve.worker.huge_pages import huge_page_zeros

    numel = weight_bytes // 4
    read = (huge_page_zeros((numel,), torch.float32) if engine.worker.huge_pages
            else torch.empty(numel))
    read.fill_(1.0)
    engine.add_request(tag, {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass  # the prefill, in as many chunks as the step budget makes it
    pairs = []
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            begin = time.perf_counter()
            engine.step()
            middle = time.perf_counter()
            read.sum()
            pairs.append((middle - begin, time.perf_counter() - middle))
    return pairs


def _timed_rounds(engine, captured, chosen: int, prompts, rounds: int, tag: str,
                  log: Callable[[str], None] | None = None, bandwidth=None, gemv=None):
    """``rounds`` alternating rounds of both modes at every concurrency: the median step
    of each run, a captured single stream's ms a step outside its linear layers and
    attention (timed by the step itself), each round's streaming bandwidth and, right
    after it, the GEMV's over the model's weights (``gemv()``)."""
    runs: dict[str, dict[int, list[float]]] = {m: {c: [] for c in CONCURRENCY} for m in MODES}
    outside: list[float] = []
    bandwidths: list[float] = []
    gemvs: list[dict[int, float]] = []
    for r in range(rounds):
        if bandwidth is not None:
            bandwidths.append(bandwidth())
        if gemv is not None:
            gemvs.append(gemv())
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            captured.max_rows = chosen if mode == "captured" else 0
            for c in CONCURRENCY:
                engine.reset_prefix_cache()
                parts = captured.profiler = _PartTimes()
                steps = concurrent_decode_steps(engine, prompts[:c], f"{tag}-{mode}-{r}-{c}",
                                                NEW_TOKENS)
                runs[mode][c].append(statistics.median(steps))
                if mode == "captured" and c == 1:
                    outside.append(1000 * (sum(steps) - sum(parts.seconds.values()))
                                   / len(steps))
        if log is not None:
            log(f"  round {r + 1} of {rounds}: " + "; ".join(
                f"{c} at once {1000 * runs['eager'][c][-1]:.2f} -> "
                f"{1000 * runs['captured'][c][-1]:.2f} ms" for c in CONCURRENCY))
    return runs, outside, bandwidths, gemvs


def run_captured_bench(model_dir: str, requests: Sequence[BenchRequest],
                       engine_args: dict[str, Any], rounds: int,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    from kvserve.bench.instruments.decode import matmul_weight_bytes
    from kvserve.bench.instruments.roofline import measure_apart
    from kvserve.bench.instruments.throughput import load_llm

    if engine_args.get("enforce_eager") or engine_args.get("speculative_config"):
        raise ValueError("kvserve bench captured compares the captured step with eager on "
                         "one token a step: run it without --enforce-eager and "
                         "speculative decoding")
    prompts = [list(r.prompt_token_ids[:PROMPT_TOKENS]) for r in requests[:max(CONCURRENCY)]]
    if len(prompts) < max(CONCURRENCY):
        raise ValueError(f"the workload needs at least {max(CONCURRENCY)} requests")
    llm, start_s = load_llm(model_dir, engine_args)
    engine = llm.engine
    captured = engine.worker.runner.captured
    if captured is None or captured.max_rows == 0:
        raise ValueError("this engine runs no captured step (see its start-up log)")
    chosen = captured.max_rows
    # eager as under --enforce-eager: its few-row GEMMs tuned (the engine skips that when
    # the captured step takes every few-row decode step)
    compute_thread().call(engine.worker.tune_eager_few_rows)
    log(f"engine ready in {start_s:.1f}s; captured step for 1-{chosen} rows")
    weight_bytes = matmul_weight_bytes(engine.worker.runner.model)
    profiler, interval = captured.profiler, engine.worker.profiler.interval
    engine.worker.profiler.set_interval(0)  # no profiled step among the timed ones
    try:
        _timed_rounds(engine, captured, chosen, prompts, 1, "warm")  # both modes, all sizes
        runs, outside, bandwidths, gemvs = _timed_rounds(
            engine, captured, chosen, prompts, rounds, "run", log,
            lambda: measure_apart("measure_stream_bandwidth"),
            lambda: compute_thread().call(gemv_pass_bandwidth, engine.worker.runner.model,
                                          engine.worker.kernels))
        read_pairs = {}
        for mode in MODES:
            captured.max_rows = chosen if mode == "captured" else 0
            engine.reset_prefix_cache()
            read_pairs[mode] = _paired_reads(engine, prompts[0], f"paired-{mode}",
                                             weight_bytes)
        captured.profiler = profiler  # the profiled pass reports through the profiler
        split = {}
        for mode in MODES:
            captured.max_rows = chosen if mode == "captured" else 0
            engine.reset_prefix_cache()
            split[mode] = _profiled_split(engine, prompts[0], f"profile-{mode}")
    finally:
        captured.max_rows, captured.profiler = chosen, profiler
        engine.worker.profiler.set_interval(interval)
        engine.close()
    bandwidth = max(bandwidths)
    floor_s = weight_bytes / (bandwidth * 1e9)
    step_ms = {m: {c: 1000 * statistics.median(runs[m][c]) for c in CONCURRENCY} for m in MODES}
    return {
        "engine_start_s": start_s, "captured_rows": chosen,
        "captured_at_start_ms": {n: [1000 * e, 1000 * c] for n, (e, c) in
                                 captured.start_times.items()},
        "stream_bandwidth_gbs": bandwidth, "round_bandwidth_gbs": bandwidths,
        "weight_bytes": weight_bytes,
        "stream_floor_ms": 1000 * floor_s, "rounds": rounds,
        "step_ms": step_ms,
        "round_step_ms": {m: {c: [1000 * s for s in runs[m][c]] for c in CONCURRENCY}
                          for m in MODES},
        # a floor is the least a step can take: the median step over the best read
        "single_stream_vs_floor": {m: step_ms[m][1] / (1000 * floor_s) for m in MODES},
        "round_gemv_bandwidth_gbs": {n: [g[n] for g in gemvs] for n in GEMV_ROWS},
        **paired_figures(runs, bandwidths, gemvs, read_pairs),
        "paired_read_gbs": {m: weight_bytes / statistics.median(rd for _, rd in read_pairs[m])
                            / 1e9 for m in MODES},
        "profiled_step_ms": split,
        # a captured single-stream step less its linear layers and attention, by round
        "captured_outside_gemm_and_attention_ms": outside,
        # the same from the profiled pass (eager's hooks add to its step)
        "profiled_outside_gemm_and_attention_ms": {
            m: split[m]["step"] - split[m]["linear"] - split[m]["attention"] for m in MODES},
    }


def paired_figures(runs: dict[str, dict[int, list[float]]], bandwidths: list[float],
                   gemvs: list[dict[int, float]],
                   read_pairs: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """The ratios, each the median of ratios taken at one moment
    (kvserve.bench.instruments.paired): eager's step over captured's by round; the native
    GEMV's pass over the same round's streaming read; each single-stream step over the
    read of its weights' bytes right after it."""
    return {
        "speedup": {c: paired_ratio(runs["eager"][c], runs["captured"][c])
                    for c in CONCURRENCY},
        "gemv_vs_stream": {n: paired_ratio([g[n] for g in gemvs], bandwidths)
                           for n in GEMV_ROWS},
        "single_stream_vs_paired_read": {
            m: paired_ratio([st for st, _ in read_pairs[m]], [rd for _, rd in read_pairs[m]])
            for m in MODES},
    }


def cmd_captured(args) -> int:
    """``kvserve bench captured``: the captured step against eager."""
    from kvserve.bench.bench_setup import rounds_bench_setup, write_result_json
    from kvserve.bench.reports import report

    model_dir, engine_args, wl, info = rounds_bench_setup(args, "kvserve captured")
    try:
        result = run_captured_bench(str(model_dir), wl.requests, engine_args, args.rounds)
    except ValueError as exc:
        raise SystemExit(f"kvserve: error: {exc}") from None
    floor = result["stream_floor_ms"]
    print(report.format_table(
        ["requests at once", "eager ms/step", "captured ms/step", "speed-up"],
        [(c, result["step_ms"]["eager"][c], result["step_ms"]["captured"][c],
          ratio_cell(result["speedup"][c])) for c in CONCURRENCY]))
    print(f"streaming floor {floor:.2f} ms ({result['stream_bandwidth_gbs']:.1f} GB/s): "
          + ", ".join(f"{m} {result['single_stream_vs_floor'][m]:.2f}x" for m in MODES))
    for mode in MODES:
        parts = result["profiled_step_ms"][mode]
        print(f"{mode} profiled step, ms: " + ", ".join(f"{p} {v:.2f}" for p, v in parts.items())
              + "; outside linear and attention "
              + f"{result['profiled_outside_gemm_and_attention_ms'][mode]:.2f}")
    for m, ratio in result["single_stream_vs_paired_read"].items():
        print(f"{m} single-stream step over a streaming read of its weights right after "
              f"it (each step a round): {describe_ratio(ratio)}")
    for n, ratio in result["gemv_vs_stream"].items():
        print(f"native GEMV pass over the weights at {n} rows over the round's streaming "
              f"read: {describe_ratio(ratio)}")
    print("captured single-stream step outside linear and attention, ms by round: "
          + ", ".join(f"{v:.2f}" for v in result["captured_outside_gemm_and_attention_ms"]))
    if args.json:
        write_result_json(args.json, info, model_dir, wl, engine_args, result)
    return 0

"""``kvserve bench metrics``: what observability costs the engine, in one run.

One engine, the same requests, rounds alternating between

- off: the engine stepped alone, the step profiler off;
- on: everything a server adds per step — the step profiler at its interval, the
  engine's stats read into a snapshot, and the recorder fed (Prometheus series, the
  live window behind the dashboard) exactly as the server's engine thread does.

Reported: the wall time of each round, on over off as the median of the rounds' ratios
(kvserve.bench.instruments.paired), the share of the on rounds spent inside the recorder (timed
directly: the ratio is within the machine's noise), and, while the whole batch is
running, how long rendering ``/metrics`` and building ``/v1/stats`` take (they run on the
server's event loop, never on the engine thread).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kvserve.bench.instruments.paired import PairedRatio, describe_ratio, paired_ratio
from kvserve.bench.workloads.definitions import BenchRequest
from kvserve.config import ObservabilityConfig
from kvserve.metrics import EngineSnapshot, create_recorder
from kvserve.sampling_params import SamplingParams

PROFILE_INTERVAL = 16  # the default of step_profile_interval


def _timed(fn, repeats: int = 5) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _round(engine, requests: Sequence[BenchRequest], observe: bool, tag: str) -> dict:
    engine.worker.profiler.interval = PROFILE_INTERVAL if observe else 0
    recorder = (create_recorder(ObservabilityConfig("bench", log_stats_interval=0), engine)
                if observe else None)
    start = time.perf_counter()
    for i, req in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
        rid = f"{tag}-{i}"
        engine.add_request(rid, {"prompt_token_ids": req.prompt_token_ids}, params)
        if recorder:
            recorder.on_add(rid, params, time.monotonic())
    peak, render_ms, view_ms, recording = 0, None, None, 0.0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if recorder is None:
            continue
        now = time.monotonic()
        begin = time.perf_counter()
        recorder.on_step(engine.last_step_stats, engine.last_step_preempted, now)
        recorder.on_outputs(outputs, now)
        snap = EngineSnapshot.of(engine.get_stats())
        recorder.on_state(snap)
        recording += time.perf_counter() - begin
        if snap.num_running > peak:  # reading under the fullest batch (not timed)
            peak = snap.num_running
            pause = time.perf_counter()
            render_ms = _timed(recorder.metrics.render)
            view_ms = _timed(recorder.live.view)
            start += time.perf_counter() - pause
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_running": peak, "recording_share": recording / seconds,
            "metrics_render_ms": render_ms, "stats_view_ms": view_ms}


def run_metrics_bench(model_dir: str | Path | None, requests: Sequence[BenchRequest],
                      engine_args: dict[str, Any], rounds: int,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    from kvserve import LLM

    engine = LLM(None if model_dir is None else str(model_dir), **engine_args).engine
    engine.settle()
    _round(engine, requests, True, "warm")  # a whole round: the heap and kernels settle
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for i in range(rounds):
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        for name in order:
            runs[name].append(_round(engine, requests, name == "on", f"{name}{i}"))
        ratio = runs["on"][-1]["seconds"] / runs["off"][-1]["seconds"]
        log(f"  round {i + 1} of {rounds}: off {runs['off'][-1]['seconds']:.2f}s, on "
            f"{runs['on'][-1]['seconds']:.2f}s ({ratio:.4f}x)")
    on = runs["on"]
    off_seconds, on_seconds = [r["seconds"] for r in runs["off"]], [r["seconds"] for r in on]
    return {
        "requests": len(requests), "rounds": rounds,
        "off_seconds": off_seconds, "on_seconds": on_seconds,
        "on_over_off": paired_ratio(on_seconds, off_seconds),
        # the engine thread's time inside the recorder, timed directly (the A/B ratio
        # above also holds the profiled steps' hooks, and the machine's noise)
        "recording_share": statistics.median(r["recording_share"] for r in on),
        "peak_running": max(r["peak_running"] for r in on),
        "metrics_render_ms": statistics.median(r["metrics_render_ms"] for r in on),
        "stats_view_ms": statistics.median(r["stats_view_ms"] for r in on),
    }


def overhead_text(ratio: PairedRatio | None) -> str:
    """On over off as the time observability adds: ``+0.41% (median of 3 rounds' ratios;
    -0.12 to +0.90%)`` (a ratio's two decimals would hide it)."""
    def pct(r: float) -> str:
        return f"{100 * (r - 1):+.2f}"
    if ratio is None:
        return describe_ratio(ratio)
    rounds = "1 round's ratio" if ratio.rounds == 1 else f"{ratio.rounds} rounds' ratios"
    return (f"{pct(ratio.median)}% (median of {rounds}; {pct(ratio.min)} to "
            f"{pct(ratio.max)}%)")


def cmd_metrics(args) -> int:
    """``kvserve bench metrics``: the recorder on vs off."""
    from kvserve.bench.bench_setup import rounds_bench_setup, write_result_json
    from kvserve.bench.reports import report

    model_dir, engine_args, wl, info = rounds_bench_setup(args, "kvserve metrics")
    result = run_metrics_bench(model_dir, wl.requests, engine_args, args.rounds)
    print(report.format_table(
        ["requests", "recorder share", "peak running", "/metrics render ms", "/v1/stats ms"],
        [(result["requests"], f"{100 * result['recording_share']:.2f}%", result["peak_running"],
          result["metrics_render_ms"], result["stats_view_ms"])]))
    print(f"on / off wall time: {overhead_text(result['on_over_off'])}")
    if args.json:
        write_result_json(args.json, info, model_dir, wl, engine_args, result)
    return 0

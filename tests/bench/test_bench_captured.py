"""``kvserve bench captured`` on a tiny model: both modes timed in every round, figures
derived from what was measured, and the settings it cannot compare refused."""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from kvserve.bench.captured import CONCURRENCY, GEMV_ROWS, MODES, gemv_pass_bandwidth, \
    run_captured_bench
from kvserve.bench.workloads import BenchRequest
from kvserve.worker.captured_step import MAX_ROWS


def _requests(n: int) -> list[BenchRequest]:
    return [BenchRequest([3 + (i * 7 + j) % 60 for j in range(20 + i)], 8) for i in range(n)]


def test_both_modes_are_timed_and_the_figures_follow(tiny_model_dir: Path, monkeypatch) -> None:
    from kvserve.bench.captured import NEW_TOKENS
    from kvserve.worker.captured_step import CapturedStep

    calls = []
    real = CapturedStep._run  # every captured step's native call, with or without StepInputs
    monkeypatch.setattr(CapturedStep, "_run", lambda self, *a: calls.append(1) or real(self, *a))
    lines: list[str] = []
    result = run_captured_bench(str(tiny_model_dir), _requests(8), {}, rounds=2, log=lines.append)
    # captured steps only in captured mode: a warm-up and two timed rounds at each batch
    # size, then the paired pass and the profiled one; every other step eager
    assert len(calls) == (3 * len(CONCURRENCY) + 2) * (NEW_TOKENS - 1)
    assert sum("round" in line for line in lines) == 2
    for mode in MODES:
        for c in CONCURRENCY:
            assert len(result["round_step_ms"][mode][c]) == 2
            assert result["step_ms"][mode][c] > 0
    for c in CONCURRENCY:
        assert result["speedup"][c] == pytest.approx(
            result["step_ms"]["eager"][c] / result["step_ms"]["captured"][c])
    assert result["stream_bandwidth_gbs"] == max(result["round_bandwidth_gbs"])
    for rows in GEMV_ROWS:  # the GEMV measured every round, over the same round's read
        gemv = result["round_gemv_bandwidth_gbs"][rows]
        assert len(gemv) == 2 and all(g > 0 for g in gemv)
        assert result["gemv_vs_stream"][rows] == pytest.approx(statistics.median(
            g / b for g, b in zip(gemv, result["round_bandwidth_gbs"])))
    assert result["single_stream_vs_floor"]["captured"] == pytest.approx(
        result["step_ms"]["captured"][1] / result["stream_floor_ms"])
    for mode in MODES:  # quartiles of step / read pairs, and the reads' rate
        q = result["single_stream_vs_paired_read"][mode]
        assert len(q) == 3 and 0 < q[0] <= q[1] <= q[2]
        assert result["paired_read_gbs"][mode] > 0
    split = result["profiled_step_ms"]["captured"]
    assert split["linear"] > 0 and split["attention"] > 0
    assert result["profiled_outside_gemm_and_attention_ms"]["captured"] == pytest.approx(
        split["step"] - split["linear"] - split["attention"])
    outside = result["captured_outside_gemm_and_attention_ms"]
    # a round's mean step less its timed parts (a mean: one slow step can make it exceed
    # the median step, so only its sign is certain)
    assert len(outside) == 2 and all(v > 0 for v in outside)
    assert split["step"] >= split["linear"] + split["attention"]
    assert result["captured_rows"] == MAX_ROWS  # the suite captures every step it can


@pytest.mark.parametrize("engine_args, match", [
    ({"enforce_eager": True}, "without --enforce-eager"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "speculative decoding"),
])
def test_settings_it_cannot_compare_are_refused(tiny_model_dir: Path, engine_args, match):
    with pytest.raises(ValueError, match=match):
        run_captured_bench(str(tiny_model_dir), _requests(8), engine_args, rounds=1)


def test_too_few_requests_are_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="at least 8 requests"):
        run_captured_bench(str(tiny_model_dir), _requests(3), {}, rounds=1)


@pytest.mark.parametrize("layout", ["panels", "dense"])
def test_gemv_pass_reads_every_float32_linear_weight_as_the_captured_step_does(
        tiny_model_dir: Path, monkeypatch, layout) -> None:
    from kvserve import LLM
    from kvserve.worker.row_padding import packed_linears
    engine = LLM(str(tiny_model_dir), num_threads=1).engine
    kernels, model = engine.worker.kernels, engine.worker.runner.model
    layers = packed_linears(model)
    if layout == "dense":
        for m in layers:
            m.restore_dense_weight()  # start-up let it go
            m.panel_weight, m.panel_max_rows = None, 0
    assert all((m.panel_weight is not None) == (layout == "panels") for m in layers)
    read = []
    gemv = "gemv_panels" if layout == "panels" else "gemv_rows"
    monkeypatch.setattr(kernels, gemv, lambda x, w: read.append((x.shape[0], w)))
    rates = gemv_pass_bandwidth(model, kernels, passes=3)
    engine.close()
    assert list(rates) == list(GEMV_ROWS) and all(r > 0 for r in rates.values())
    weights = [m.panel_weight if layout == "panels" else m.weight for m in layers]
    for rows in GEMV_ROWS:  # a warm-up pass and three timed ones, each over every weight
        passes = [w for n, w in read if n == rows]
        assert len(passes) == 4 * len(weights)
        assert all(a is b for a, b in zip(passes, weights * 4))

"""``kvserve bench captured`` on a tiny model: both modes timed in every round, figures
derived from what was measured, and the settings it cannot compare refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.bench.experiments.captured import CONCURRENCY, GEMV_ROWS, MODES, NEW_TOKENS, \
    gemv_pass_bandwidth, paired_figures, run_captured_bench
from kvserve.bench.instruments.paired import PairedRatio
from kvserve.bench.workloads.definitions import BenchRequest
from kvserve.cli import main
from kvserve.worker.captured_step import MAX_ROWS


def _requests(n: int) -> list[BenchRequest]:
    return [BenchRequest([3 + (i * 7 + j) % 60 for j in range(20 + i)], 8) for i in range(n)]


def test_both_modes_are_timed_and_the_figures_follow(tiny_model_dir: Path, monkeypatch) -> None:
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
        assert result["speedup"][c].per_round == pytest.approx(
            [eager / captured for eager, captured in zip(
                result["round_step_ms"]["eager"][c], result["round_step_ms"]["captured"][c])])
    assert result["stream_bandwidth_gbs"] == max(result["round_bandwidth_gbs"])
    for rows in GEMV_ROWS:  # the GEMV measured every round, over the same round's read
        gemv = result["round_gemv_bandwidth_gbs"][rows]
        assert len(gemv) == 2 and all(g > 0 for g in gemv)
        assert result["gemv_vs_stream"][rows].per_round == pytest.approx(
            [g / b for g, b in zip(gemv, result["round_bandwidth_gbs"])])
    assert result["single_stream_vs_floor"]["captured"] == pytest.approx(
        result["step_ms"]["captured"][1] / result["stream_floor_ms"])
    for mode in MODES:  # a ratio for every decode step and its read, and the reads' rate
        paired = result["single_stream_vs_paired_read"][mode]
        assert paired.rounds == NEW_TOKENS - 1 and 0 < paired.min <= paired.median
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


def test_every_ratio_is_the_median_of_ratios_taken_at_one_moment() -> None:
    # eager over captured by round 2, 2, 6 (median 2); the medians' ratio is 4
    runs = {"eager": {c: [0.002, 0.004, 0.006] for c in CONCURRENCY},
            "captured": {c: [0.001, 0.002, 0.001] for c in CONCURRENCY}}
    bandwidths = [10.0, 20.0, 10.0]
    gemvs = [{n: 20.0 for n in GEMV_ROWS}, {n: 40.0 for n in GEMV_ROWS},
             {n: 60.0 for n in GEMV_ROWS}]
    read_pairs = {"eager": [(2.0, 1.0), (4.0, 2.0), (6.0, 1.0)],
                  "captured": [(1.0, 1.0), (3.0, 1.0)]}
    figures = paired_figures(runs, bandwidths, gemvs, read_pairs)
    for c in CONCURRENCY:
        assert figures["speedup"][c] == PairedRatio(2.0, 2.0, 6.0, 3, (2.0, 2.0, 6.0))
    for n in GEMV_ROWS:
        assert figures["gemv_vs_stream"][n] == PairedRatio(2.0, 2.0, 6.0, 3, (2.0, 2.0, 6.0))
    assert figures["single_stream_vs_paired_read"]["eager"].median == 2.0
    assert figures["single_stream_vs_paired_read"]["captured"] == PairedRatio(
        2.0, 1.0, 3.0, 2, (1.0, 3.0))


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
    from kvserve.worker.tuning.row_padding import packed_linears
    engine = LLM(str(tiny_model_dir), num_threads=1).engine
    kernels, model = engine.worker.kernels, engine.worker.runner.model
    layers = packed_linears(model)
    if layout == "dense":
        for m in layers:
            m.method.restore_dense_weight(m)  # start-up let it go
            m.method.panel_weight, m.method.panel_max_rows = None, 0
    assert all((m.method.panel_weight is not None) == (layout == "panels") for m in layers)
    read = []
    gemv = "gemv_panels" if layout == "panels" else "gemv_rows"
    monkeypatch.setattr(kernels, gemv, lambda x, w: read.append((x.shape[0], w)))
    rates = gemv_pass_bandwidth(model, kernels, passes=3)
    engine.close()
    assert list(rates) == list(GEMV_ROWS) and all(r > 0 for r in rates.values())
    weights = [m.method.panel_weight if layout == "panels" else m.weight for m in layers]
    for rows in GEMV_ROWS:  # a warm-up pass and three timed ones, each over every weight
        passes = [w for n, w in read if n == rows]
        assert len(passes) == 4 * len(weights)
        assert all(a is b for a, b in zip(passes, weights * 4))


def test_the_command_prints_and_saves_the_paired_ratios(tiny_model_dir: Path, tmp_path: Path,
                                                       monkeypatch, capsys) -> None:
    from kvserve.bench.experiments import captured

    runs = {"eager": {c: [0.002, 0.004, 0.006] for c in CONCURRENCY},
            "captured": {c: [0.001, 0.002, 0.001] for c in CONCURRENCY}}
    gemvs = [{n: 5.0 for n in GEMV_ROWS}, {n: 10.0 for n in GEMV_ROWS},
             {n: 15.0 for n in GEMV_ROWS}]
    read_pairs = {m: [(2.0, 1.0), (3.0, 1.0)] for m in MODES}
    parts = {"linear": 1.0, "attention": 0.5, "step": 2.0}
    result = {"stream_floor_ms": 1.0, "stream_bandwidth_gbs": 20.0,
              "step_ms": {m: {c: 1.0 for c in CONCURRENCY} for m in MODES},
              "single_stream_vs_floor": {m: 1.5 for m in MODES},
              "profiled_step_ms": {m: parts for m in MODES},
              "profiled_outside_gemm_and_attention_ms": {m: 0.5 for m in MODES},
              "captured_outside_gemm_and_attention_ms": [0.4, 0.5, 0.6],
              **paired_figures(runs, [10.0, 20.0, 10.0], gemvs, read_pairs)}
    monkeypatch.setattr(captured, "run_captured_bench", lambda *args: result)
    assert main(["bench", "captured", "--model", str(tiny_model_dir), "--workload", "random",
                 "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                 "--json", str(tmp_path / "c.json")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("2.00x (2.00–6.00)") == len(CONCURRENCY)  # the table's rows
    assert ("eager single-stream step over a streaming read of its weights right after it "
            "(each step a round): 2.50x (median of 2 rounds' ratios; 2.00–3.00)") in printed
    assert ("native GEMV pass over the weights at 1 rows over the round's streaming read: "
            "0.50x (median of 3 rounds' ratios; 0.50–1.50)") in printed
    saved = json.loads((tmp_path / "c.json").read_text())["result"]
    assert saved["speedup"]["8"]["per_round"] == [2.0, 2.0, 6.0]

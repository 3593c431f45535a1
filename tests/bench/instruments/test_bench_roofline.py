"""Roofline arithmetic helpers and a (tiny, untimed) measurement smoke test."""

from __future__ import annotations

import pytest

from kvserve.bench.instruments.roofline import (
    GemmPeak,
    MatmulShape,
    RooflineResult,
    gemm_peak,
    decode_bandwidth_floor_s,
    measure_apart,
    flops_per_token,
    matmul_params,
    measure_gemm_gflops,
    roofline_bound,
    roofline_share,
    workload_flops,
)
from kvserve.bench.workloads.models import BENCH_MODELS

BENCH_100M_CONFIG = {
    "hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 4,
    "intermediate_size": 2048, "num_hidden_layers": 12, "vocab_size": 8192,
}


def test_flops_per_token() -> None:
    assert flops_per_token(100) == 200
    assert flops_per_token(100, num_layers=2, hidden=8, ctx=10) == 200 + 4 * 2 * 10 * 8


TINY_CONFIG = {"hidden_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
               "intermediate_size": 8, "num_hidden_layers": 1, "vocab_size": 10}


def test_workload_flops_count_the_lm_head_only_where_a_token_is_sampled() -> None:
    shape = MatmulShape.from_config(TINY_CONFIG)
    # q, o: 4x4 each; k, v: 4x2 each; gate, up, down: 4x8 each -> 144; LM head 4x10
    assert (shape.layer_params, shape.lm_head_params) == (144, 40)
    assert shape.params == matmul_params(TINY_CONFIG) == 184
    # prompt 3, 2 outputs: the layers run on 4 tokens (3 prompt, the first output fed
    # back), the LM head on 2 (the last prompt token, the fed-back output), attention
    # over contexts 1 + 2 + 3 + 4 = 10
    assert workload_flops([(3, 2)], shape) == 2 * 144 * 4 + 2 * 40 * 2 + 4 * 1 * 4 * 10 == 1472
    # prompt 5, 1 output: layers on 5 tokens, the LM head on the last, contexts 1..5 = 15
    assert workload_flops([(5, 1)], shape) == 2 * 144 * 5 + 2 * 40 * 1 + 4 * 4 * 15 == 1760
    assert workload_flops([(3, 2), (5, 1)], shape) == 1472 + 1760


def test_the_peak_is_the_best_gemm_of_every_measurement() -> None:
    before = RooflineResult(2, {"16x8x8": 40.0, "packed 64x8x8": 55.0}, 30.0, 15.0,
                            "before the runs")
    after = RooflineResult(2, {"16x8x8": 61.0, "packed 64x8x8": 50.0, "64^3": 58.0}, 25.0,
                           16.0, "after the runs")
    peak = gemm_peak([before, after])
    assert (peak.gflops, peak.shape, peak.source) == (61.0, "16x8x8", "after the runs")
    assert gemm_peak([before]) == GemmPeak(55.0, "packed 64x8x8", "before the runs")
    assert gemm_peak([]) is None
    assert "61.0 GFLOP/s (16x8x8, after the runs)" == peak.describe()
    both = before.best_of(after)
    assert both.peak_gflops == peak.gflops and both.gemm_gflops["packed 64x8x8"] == 55.0
    assert (both.sum_bandwidth_gbs, both.gemv_bandwidth_gbs) == (30.0, 16.0)


def test_bounds() -> None:
    b = roofline_bound(params=5e8, tokens=10, gflops=100)
    assert b["flops"] == pytest.approx(1e10)
    assert b["seconds"] == pytest.approx(0.1)
    assert b["tokens_per_s"] == pytest.approx(100)
    assert decode_bandwidth_floor_s(4e8, 20) == pytest.approx(0.02)
    assert roofline_share(1e10, 1.0, 100) == pytest.approx(0.1)
    assert roofline_share(1e10, 0.0, 100) == 0.0


def test_param_counts() -> None:
    assert matmul_params(BENCH_100M_CONFIG) == 12 * (2 * 768 * 768 + 2 * 768 * 256 + 3 * 768 * 2048) + 768 * 8192
    assert 86e6 < BENCH_MODELS["bench-100m"].num_params() < 90e6
    assert 32e6 < BENCH_MODELS["bench-30m"].num_params() < 36e6


def test_measure_smoke() -> None:
    assert measure_gemm_gflops(4, 32, 32, repeats=1) > 0
    r = RooflineResult(2, {"a": 10.0, "b": 30.0}, 35.0, 17.0)
    assert r.peak_gflops == 30.0 and r.bandwidth_gbs == 35.0
    assert r.to_dict()["peak_gflops"] == 30.0


def test_a_read_measured_apart_runs_in_a_child_process() -> None:
    """A streaming read measured for a bench with an engine in its process: the child's
    sum, none of this process's threads."""
    import os
    threads = set(os.listdir("/proc/self/task"))
    assert measure_apart("measure_sum_bandwidth", num_mb=8, repeats=1) > 0
    assert set(os.listdir("/proc/self/task")) == threads
    with pytest.raises(RuntimeError, match="no_such_measurement"):
        measure_apart("no_such_measurement")


def test_roofline_command_writes_json_and_plot(tmp_path) -> None:
    import json

    from kvserve.cli import main
    out = tmp_path / "roof.json"
    rc = main(["bench", "roofline", "--ms", "1,4", "--k", "64", "--n", "64", "--cube", "0",
               "--repeats", "1", "--json", str(out), "--plot", str(tmp_path / "roof.png")])
    assert rc == 0 and (tmp_path / "roof.png").stat().st_size > 0
    data = json.loads(out.read_text())
    assert set(data["roofline"]["gemm_gflops"]) >= {"1x64x64", "4x64x64"}
    best = max(data["roofline"]["gemm_gflops"].items(), key=lambda item: item[1])
    assert (data["gemm_peak"]["gflops"], data["gemm_peak"]["shape"]) == (best[1], best[0])

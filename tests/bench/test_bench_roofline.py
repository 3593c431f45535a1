"""Roofline arithmetic helpers and a (tiny, untimed) measurement smoke test."""

from __future__ import annotations

import pytest

from kvserve.bench.models import BENCH_MODELS
from kvserve.bench.roofline import (
    RooflineResult,
    decode_bandwidth_floor_s,
    flops_per_token,
    matmul_params,
    measure_gemm_gflops,
    roofline_bound,
    roofline_share,
    workload_flops,
)

BENCH_100M_CONFIG = {
    "hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 4,
    "intermediate_size": 2048, "num_hidden_layers": 12, "vocab_size": 8192,
}


def test_flops_per_token() -> None:
    assert flops_per_token(100) == 200
    assert flops_per_token(100, num_layers=2, hidden=8, ctx=10) == 200 + 4 * 2 * 10 * 8


def test_workload_flops() -> None:
    # prompt 3 + 2 outputs -> 4 forward tokens, contexts 1+2+3+4 = 10
    assert workload_flops([(3, 2)], params=10, num_layers=1, hidden=1) == 2 * 10 * 4 + 4 * 10
    assert workload_flops([(3, 2), (3, 2)], 10) == 2 * 80


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


def test_roofline_command_writes_json_and_plot(tmp_path) -> None:
    import json

    from kvserve.entrypoints.cli import main
    out = tmp_path / "roof.json"
    rc = main(["bench", "roofline", "--ms", "1,4", "--k", "64", "--n", "64", "--cube", "0",
               "--repeats", "1", "--json", str(out), "--plot", str(tmp_path / "roof.png")])
    assert rc == 0 and (tmp_path / "roof.png").stat().st_size > 0
    data = json.loads(out.read_text())
    assert set(data["roofline"]["gemm_gflops"]) >= {"1x64x64", "4x64x64"}

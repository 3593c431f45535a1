"""Which few-row path each layer takes: the fastest one at every count up to its limit,
and only when it beats oneDNN's packed GEMM clearly."""
from __future__ import annotations

import pytest

from kvserve.model.linear_method import FloatLinearMethod
from kvserve.worker.tuning import small_gemm


class _Layer:
    def __init__(self, dtype="float32"):
        import torch
        self.weight = type("W", (), {"dtype": getattr(torch, dtype), "is_meta": False})()
        self.method = FloatLinearMethod()


@pytest.fixture
def layers():
    return [_Layer(), _Layer(), _Layer("bfloat16")]


def _counts(layers, native=None) -> dict[str, int]:
    return small_gemm.path_counts(small_gemm.choose_layer_paths(layers, native=native))


def _times(monkeypatch, table):
    """table[path][rows] -> per-layer seconds."""
    monkeypatch.setattr(small_gemm, "_layer_times",
                        lambda linears, rows, path, rounds, native: table[path][rows])


def test_each_layer_takes_its_fastest_path_while_it_stays_the_fastest(monkeypatch, layers):
    rows = {1: [1.0, 1.0, 1.0], 2: [1.0, 1.0, 1.0], 3: [1.0, 1.0, 1.0], 4: [1.0, 1.0, 1.0]}
    _times(monkeypatch, {
        "packed": rows,
        "dense": {1: [0.95, 0.5, 0.6], 2: [0.95, 0.5, 0.6], 3: [0.95, 0.95, 0.95],
                  4: [0.95, 0.95, 0.95]},
        "native": {1: [0.7, 0.8, 0.1], 2: [0.8, 0.9, 0.1], 3: [0.85, 0.9, 0.1],
                   4: [0.95, 0.9, 0.1]}})
    native = object()
    counts = _counts(layers, native)
    # layer 0: native at 1-3 (at 4 it gains under 10 %); layer 1: dense at 1-2;
    # layer 2 is bfloat16, so never native: dense at 1-2
    assert counts == {"native<=3": 1, "dense<=2": 2}
    assert (layers[0].method.native_max_rows, layers[0].method.native) == (3, native)
    assert (layers[1].method.dense_max_rows, layers[1].method.native_max_rows) == (2, 0)
    assert layers[2].method.native is None
    small_gemm._use(layers[2], "native", 4, native)  # float32's kernel: never on bfloat16
    assert (layers[2].method.native_max_rows, layers[2].method.native) == (0, None)


def test_without_the_kernels_only_dense_is_tried(monkeypatch, layers):
    slow = {r: [1.0] * 3 for r in small_gemm.DENSE_ROWS}
    _times(monkeypatch, {"packed": slow, "dense": slow})
    assert _counts(layers) == {"packed": 3}

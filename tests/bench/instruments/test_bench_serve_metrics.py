"""Serving metrics on synthetic timings, checked against hand arithmetic."""

from __future__ import annotations

import pytest

from kvserve.bench.instruments.serve_metrics import (
    RequestRecord,
    compute_serve_metrics,
    peak_concurrency,
    percentile,
)


def _records() -> list[RequestRecord]:
    a = RequestRecord(0.0, 0.4, [0.1, 0.2, 0.4], prompt_len=10, output_len=3, success=True)
    b = RequestRecord(0.2, 0.7, [0.5, 0.6], prompt_len=20, output_len=2, success=True)
    c = RequestRecord(0.3, 0.35, [], prompt_len=5, success=False, error="boom")
    return [a, b, c]


def test_per_request_quantities() -> None:
    a, b, _ = _records()
    assert a.ttft == pytest.approx(0.1) and a.e2el == pytest.approx(0.4)
    assert a.tpot == pytest.approx(0.15)  # (0.4 - 0.1) / (3 - 1)
    assert a.itls == pytest.approx([0.1, 0.2])
    assert b.tpot == pytest.approx(0.2)  # (0.5 - 0.3) / 1


def test_aggregate_metrics() -> None:
    m = compute_serve_metrics(_records(), slos_ms={"ttft": 150})
    assert (m.completed, m.failed) == (2, 1)
    assert m.duration_s == pytest.approx(0.7)
    assert m.total_input_tokens == 30 and m.total_output_tokens == 5
    assert m.request_throughput == pytest.approx(2 / 0.7)
    assert m.output_throughput == pytest.approx(5 / 0.7)
    assert m.total_token_throughput == pytest.approx(35 / 0.7)
    assert m.peak_concurrency == 3
    assert m.goodput == pytest.approx(1 / 0.7)  # only a meets TTFT <= 150 ms
    lat = m.latency_ms
    assert lat["ttft"]["mean"] == pytest.approx(200)
    assert lat["ttft"]["median"] == pytest.approx(200)
    assert lat["ttft"]["p99"] == pytest.approx(100 + 200 * 0.99)
    assert lat["tpot"]["mean"] == pytest.approx(175)
    assert lat["itl"]["mean"] == pytest.approx(400 / 3)
    assert lat["itl"]["median"] == pytest.approx(100)
    assert lat["itl"]["p99"] == pytest.approx(198)
    assert lat["e2el"]["mean"] == pytest.approx(450)
    flat = m.to_dict()
    assert flat["mean_ttft_ms"] == pytest.approx(200) and flat["completed"] == 2


def test_explicit_duration_and_empty() -> None:
    m = compute_serve_metrics(_records(), duration_s=2.0)
    assert m.request_throughput == pytest.approx(1.0) and m.goodput is None
    empty = compute_serve_metrics([])
    assert empty.completed == 0 and empty.request_throughput == 0.0
    with pytest.raises(ValueError):
        compute_serve_metrics(_records(), slos_ms={"itl": 1})


def test_percentile_and_peak() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([4, 1, 3, 2], 100) == 4
    assert percentile([1, 2, 3, 4, 5], 25) == pytest.approx(2)
    assert peak_concurrency([(0, 1), (1, 2)]) == 1  # touching intervals do not overlap
    assert peak_concurrency([(0, 3), (1, 2), (1.5, 4), (3.5, 5)]) == 3
    assert peak_concurrency([]) == 0

"""``kvserve bench batch``'s interference rounds, with a stand-in server: the ratios are
the median of the rounds' ratios, a round with a failed realtime request dropped."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvserve.bench.experiments import batch


class _FakeBatchServer:
    """Answers the Batch API calls ``interference`` makes; every batch has lines done."""

    def __init__(self) -> None:
        self.created = 0
        self.http = SimpleNamespace(post=lambda path: None)

    def create_batch(self, requests) -> str:
        self.created += 1
        return f"batch-{self.created}"

    def batch(self, batch_id: str) -> dict:
        return {"request_counts": {"completed": 3}}

    def wait(self, batch_id: str, statuses) -> dict:
        return {"status": "cancelled"}


def test_interference_ratios_are_paired_by_round(monkeypatch: pytest.MonkeyPatch) -> None:
    # realtime P99 TTFT by call: the warm-up, then each round's two runs in the round's
    # order (alone first in odd-numbered rounds); round 2's run with the batch failed one
    ttft = iter([999.0, 10.0, 30.0, 15.0, 40.0, 20.0, 60.0, 40.0, 16.0])
    failed = iter([0, 0, 0, 1, 0, 0, 0, 0, 0])

    def realtime(server, requests, rate, seed):
        t = next(ttft)
        return {"p99_ttft_ms": t, "p99_tpot_ms": t / 10, "p50_ttft_ms": t, "p50_tpot_ms": 1.0,
                "completed": 4, "failed": next(failed)}

    monkeypatch.setattr(batch, "_realtime", realtime)
    result = batch.interference(_FakeBatchServer(), [], [], 1.0, 4, log=lambda line: None)
    with_batch = [r["p99_ttft_ms"] for r in result["rounds"]["with_batch"]]
    alone = [r["p99_ttft_ms"] for r in result["rounds"]["alone"]]
    assert (alone, with_batch) == ([10.0, 40.0, 20.0, 16.0], [30.0, 15.0, 60.0, 40.0])
    # ratios 3.0, (round 2 dropped), 3.0, 2.5: median 3.0; the medians' ratio is 35 / 18
    ttft_ratio = result["p99_ttft_ratio"]
    assert ttft_ratio.per_round == (3.0, 3.0, 2.5) and ttft_ratio.median == 3.0
    assert (ttft_ratio.min, ttft_ratio.max) == (2.5, 3.0)
    assert result["p99_tpot_ratio"].per_round == pytest.approx((3.0, 3.0, 2.5))
    assert result["batch_lines_done_per_round"] == 0  # 3 before and after: none meanwhile

"""``kvserve bench overlap`` on a tiny model: each batch size's host work measured from
a real decode, and the three ways of running a step timed."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.bench.overlap import BATCH_SIZES, run_overlap_bench


def test_every_batch_size_is_measured(tiny_model_dir: Path) -> None:
    lines: list[str] = []
    result = run_overlap_bench(str(tiny_model_dir), {}, rounds=2, log=lines.append)
    assert list(result["batches"]) == list(BATCH_SIZES) and len(lines) == len(BATCH_SIZES)
    for b in result["batches"].values():
        assert 0 < b["host_ms"] and 0 < b["host_share"] < 1
        # serial runs the step and then the host work: never shorter than the work
        assert b["serial_ms"] >= b["host_ms"]
        assert b["overlapped_ms"] >= b["host_ms"] * 0.9
        assert b["overlapped_vs_serial"] == pytest.approx(b["overlapped_ms"] / b["serial_ms"])
        assert len(b["round_overlapped_vs_serial"]) == 2

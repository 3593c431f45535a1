"""``kvserve bench overlap`` on a tiny model: each batch size's host work measured over
the real decode steps, the three ways of running a step timed, and a pool too small
for a batch refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.bench.overlap import BATCH_SIZES, NEW_TOKENS, overlap_times, run_overlap_bench


def test_every_batch_size_is_measured(tiny_model_dir: Path) -> None:
    lines: list[str] = []
    result = run_overlap_bench(str(tiny_model_dir), {}, rounds=2, log=lines.append)
    assert list(result["batches"]) == list(BATCH_SIZES) and len(lines) == len(BATCH_SIZES)
    for b in result["batches"].values():
        # decode steps only: after every prompt's first token, at most one per token left
        assert 0 < b["decode_steps"] <= NEW_TOKENS - 1
        assert 0 < b["host_ms"] < b["engine_step_ms"]
        assert b["host_share"] == pytest.approx(b["host_ms"] / b["engine_step_ms"])
        assert b["overlapped_vs_serial"] == pytest.approx(b["overlapped_ms"] / b["serial_ms"])
        assert len(b["round_overlapped_vs_serial"]) == 2


def test_a_pool_too_small_for_the_batch_is_refused(tiny_model_dir: Path) -> None:
    from kvserve import LLM

    runner = LLM(str(tiny_model_dir), num_kv_blocks=16).engine.worker.runner
    with pytest.raises(ValueError, match="KV blocks; the pool has 16"):
        overlap_times(runner, 4, 0.0)

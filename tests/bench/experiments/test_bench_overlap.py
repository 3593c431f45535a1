"""``kvserve bench overlap`` on a tiny model: each batch size's host work measured over
the real decode steps, the three ways of running a step timed, and a pool too small
for a batch refused."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvserve.bench.experiments.overlap import BATCH_SIZES, NEW_TOKENS, overlap_times, \
    run_overlap_bench
from kvserve.bench.instruments.paired import PairedRatio, summarize_ratios
from kvserve.cli import main


def test_every_batch_size_is_measured(tiny_model_dir: Path) -> None:
    lines: list[str] = []
    result = run_overlap_bench(str(tiny_model_dir), {}, rounds=2, log=lines.append)
    assert list(result["batches"]) == list(BATCH_SIZES) and len(lines) == len(BATCH_SIZES)
    for b in result["batches"].values():
        # decode steps only: after every prompt's first token, at most one per token left
        assert 0 < b["decode_steps"] <= NEW_TOKENS - 1
        assert 0 < b["host_ms"] < b["engine_step_ms"]
        assert b["host_share"] == pytest.approx(b["host_ms"] / b["engine_step_ms"])
        assert b["overlapped_vs_serial"].rounds == 2


def test_overlapped_over_serial_is_the_median_of_the_rounds_ratios(monkeypatch) -> None:
    from kvserve.bench.experiments import overlap
    from kvserve.bench.instruments import throughput

    closed = []
    engine = SimpleNamespace(reset_prefix_cache=lambda: None, close=lambda: closed.append(1),
                             worker=SimpleNamespace(runner=object()))
    monkeypatch.setattr(throughput, "load_llm",
                        lambda model_dir, engine_args: (SimpleNamespace(engine=engine), 0.0))
    monkeypatch.setattr(overlap, "host_seconds_per_step", lambda engine, batch: (1.0, 4.0, 7))
    # overlapped over serial by round 2, 2, 6 (median 2); the medians' ratio is 4
    rounds = iter([{"alone": 1.0, "serial": 1.0, "overlapped": 2.0},
                   {"alone": 1.0, "serial": 2.0, "overlapped": 4.0},
                   {"alone": 1.0, "serial": 1.0, "overlapped": 6.0}] * len(BATCH_SIZES))
    monkeypatch.setattr(overlap, "overlap_times", lambda runner, batch, host: next(rounds))
    result = run_overlap_bench("unused", {}, rounds=3, log=lambda line: None)
    assert closed == [1]
    for b in result["batches"].values():
        assert b["overlapped_vs_serial"] == PairedRatio(2.0, 2.0, 6.0, 3, (2.0, 2.0, 6.0))
        assert (b["serial_ms"], b["overlapped_ms"]) == (1000.0, 4000.0)
        assert b["host_share"] == 0.25


def test_a_pool_too_small_for_the_batch_is_refused(tiny_model_dir: Path) -> None:
    from kvserve import LLM

    runner = LLM(str(tiny_model_dir), num_kv_blocks=16).engine.worker.runner
    with pytest.raises(ValueError, match="KV blocks; the pool has 16"):
        overlap_times(runner, 4, 0.0)


def test_the_command_prints_the_paired_ratio(tiny_model_dir: Path, monkeypatch, capsys) -> None:
    from kvserve.bench.experiments import overlap

    batch = {"host_ms": 1.0, "host_share": 0.25, "serial_ms": 2.0, "overlapped_ms": 1.5,
             "overlapped_vs_serial": summarize_ratios([0.7, 0.75, 0.9])}
    monkeypatch.setattr(overlap, "run_overlap_bench",
                        lambda *args: {"rounds": 3, "batches": {1: batch}})
    assert main(["bench", "overlap", "--model", str(tiny_model_dir)]) == 0
    assert "0.75x (0.70–0.90)" in capsys.readouterr().out

"""``kvserve bench tp``, with stand-in settings' processes: tp1 and tp2 alternate by
round, and tp2 over tp1 is the median of the rounds' ratios, stored and printed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.bench.experiments import tensor_parallel
from kvserve.cli import main


def test_tp_over_tp1_is_the_median_of_the_rounds_ratios(tiny_model_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys) -> None:
    # tp2 over tp1 by round: throughput 2, 2, 6 (median 2; the medians' ratio is 4),
    # decode step 0.5, 0.5, 0.25 (median 0.5; the medians' ratio is 0.25)
    figures = {1: iter([(10.0, 4.0), (20.0, 8.0), (10.0, 8.0)]),
               2: iter([(20.0, 2.0), (40.0, 4.0), (60.0, 2.0)])}
    order = []

    def run_setting(model_dir, requests, engine_args):
        size = engine_args.get("tensor_parallel_size", 1)
        order.append(size)
        tok_s, step_ms = next(figures[size])
        return {"load_s": 1.0, "useful_tok_s": tok_s, "decode_step_ms": step_ms,
                "collective_ms_per_step": 0.1 * (size - 1),
                "broadcast_ms_per_step": 0.05 * (size - 1)}
    monkeypatch.setattr(tensor_parallel, "_run_setting", run_setting)
    assert main(["bench", "tp", "--model", str(tiny_model_dir), "--workload", "random",
                 "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                 "--rounds", "3", "--json", str(tmp_path / "tp.json")]) == 0
    assert order == [1, 2, 2, 1, 1, 2]
    printed = capsys.readouterr().out
    assert "tp2 / tp1, throughput: 2.00x (median of 3 rounds' ratios; 2.00–6.00)" in printed
    assert "tp2 / tp1, decode step: 0.50x (median of 3 rounds' ratios; 0.25–0.50)" in printed
    result = json.loads((tmp_path / "tp.json").read_text())["result"]
    assert result["throughput_ratio"] == {"median": 2.0, "min": 2.0, "max": 6.0, "rounds": 3,
                                          "per_round": [2.0, 2.0, 6.0]}
    assert result["decode_step_ratio"]["per_round"] == [0.5, 0.5, 0.25]
    assert result["median"]["tp2"]["useful_tok_s"] == 40.0

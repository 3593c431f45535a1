"""``kvserve bench metrics``: on over off is the median of the rounds' ratios, stored as
the paired statistic and printed as the time observability adds (stand-in rounds: no
model runs)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvserve.bench.experiments import metrics_overhead
from kvserve.bench.instruments.paired import PairedRatio, summarize_ratios


def test_on_over_off_is_the_median_of_the_rounds_ratios(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvserve

    # wall seconds by round: on over off 2, 2, 6 (median 2); the medians' ratio is 4
    seconds = {True: iter([9.0, 2.0, 4.0, 6.0]), False: iter([1.0, 2.0, 1.0])}  # warm-up first
    order = []

    def one_round(engine, requests, observe, tag):
        order.append("on" if observe else "off")
        return {"seconds": next(seconds[observe]), "peak_running": 3, "recording_share": 0.01,
                "metrics_render_ms": 0.5, "stats_view_ms": 0.2}
    monkeypatch.setattr(kvserve, "LLM", lambda model, **engine_args: SimpleNamespace(
        engine=SimpleNamespace(settle=lambda: None)))
    monkeypatch.setattr(metrics_overhead, "_round", one_round)
    result = metrics_overhead.run_metrics_bench(None, [], {}, 3, log=lambda line: None)
    assert order == ["on", "off", "on", "on", "off", "off", "on"]  # warm-up, then alternating
    assert result["on_over_off"] == PairedRatio(2.0, 2.0, 6.0, 3, (2.0, 2.0, 6.0))
    assert (result["on_seconds"], result["off_seconds"]) == ([2.0, 4.0, 6.0], [1.0, 2.0, 1.0])


def test_the_command_prints_and_saves_the_paired_ratio(tiny_model_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys) -> None:
    from kvserve.cli import main

    canned = {"requests": 2, "rounds": 3, "on_over_off": summarize_ratios([1.004, 0.999, 1.01]),
              "recording_share": 0.01, "peak_running": 2, "metrics_render_ms": 0.5,
              "stats_view_ms": 0.2}
    monkeypatch.setattr(metrics_overhead, "run_metrics_bench", lambda *args: dict(canned))
    assert main(["bench", "metrics", "--model", str(tiny_model_dir), "--workload", "random",
                 "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                 "--json", str(tmp_path / "m.json")]) == 0
    printed = capsys.readouterr().out
    assert ("on / off wall time: +0.40% (median of 3 rounds' ratios; -0.10 to +1.00%)"
            in printed)
    saved = json.loads((tmp_path / "m.json").read_text())["result"]["on_over_off"]
    assert saved["median"] == 1.004 and saved["per_round"] == [1.004, 0.999, 1.01]

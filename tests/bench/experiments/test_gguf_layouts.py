"""kvserve bench gguf-layouts: the runs of rows against the file's layout, timed in
alternating rounds, written as JSON and as the figures' table."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from kvserve.bench.experiments import gguf_layouts
from kvserve.bench.reports.figure_lines import LINES_OF
from kvserve.bench.reports.published import Result
from kvserve.kernels import load_kernels

pytestmark = pytest.mark.skipif(not load_kernels().available,
                                reason="the native kernels need a C compiler")
SMALL = {"formats": ("Q4_K", "Q8_0"), "shape": (64, 512),
         "cases": ((1, "cache"), (9, "cache"), (1, "memory")), "memory_bytes": 1 << 20}


def test_every_case_is_timed_in_both_layouts_each_round():
    logged = []
    result = gguf_layouts.run_gguf_layouts_bench(2, log=logged.append, **SMALL)
    assert len(logged) == 2 and result["rounds"] == 2
    for fmt in SMALL["formats"]:
        cases = result["formats"][fmt]
        assert list(cases) == ["1 row, cache", "9 rows, cache", "1 row, memory"]
        for case in cases.values():
            assert len(case["file_gmacs"]) == len(case["runs_gmacs"]) == 2
            assert min(case["file_gmacs"] + case["runs_gmacs"]) > 0
            # the file layout's time over the runs' is the runs' rate over the file's
            per_round = [r / f for f, r in zip(case["file_gmacs"], case["runs_gmacs"])]
            ratio = case["runs_over_file"]
            assert ratio["per_round"] == pytest.approx(per_round)
            assert ratio["median"] == pytest.approx(statistics.median(per_round))


def test_a_format_without_runs_is_refused():
    with pytest.raises(ValueError, match="Q4_0"):
        gguf_layouts.run_gguf_layouts_bench(1, **{**SMALL, "formats": ("Q4_0",)})


def test_the_command_writes_json_the_figures_read(tmp_path, monkeypatch, capsys):
    from kvserve.bench.cli import main

    for name, value in SMALL.items():
        monkeypatch.setattr(gguf_layouts, name.upper(), value)
    path = tmp_path / "layouts.json"
    assert main(["bench", "gguf-layouts", "--rounds", "1", "--json", str(path)]) == 0
    assert "runs against the file's layout" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["machine"]["commit"] and data["result"]["shape"] == [64, 512]
    res = Result(Path("docs/results/layouts.json"), data)
    assert res.kind == "gguf_layouts"
    lines = LINES_OF["gguf_layouts"](res, "docs")
    table = [line for line in lines if line.startswith("| Q")]
    assert len(table) == 6 and table[0].startswith("| Q4_K, 1 row, cache | ")
    assert "`bench gguf-layouts`, 1 round, " in lines[-1]

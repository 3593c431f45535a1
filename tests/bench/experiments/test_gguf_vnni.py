"""kvserve bench gguf-vnni: the kernels built with AVX-512 VNNI against their AVX2 build,
timed in alternating rounds (on a CPU with VNNI), written as JSON and as the figures'
table; refused on a CPU without it, where both builds are the AVX2 code."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.bench.experiments import gguf_vnni
from kvserve.bench.reports.figure_lines import LINES_OF
from kvserve.bench.reports.published import Result
from kvserve.kernels import load_kernels
from kvserve.kernels.build import cpu_has_any

pytestmark = pytest.mark.skipif(not load_kernels().available,
                                reason="the native kernels need a C compiler")
SMALL = {"formats": ("Q5_K", "Q8_0"), "shape": (64, 512),
         "cases": ((1, "cache"), (9, "cache"), (1, "memory")), "memory_bytes": 1 << 20}
VNNI = cpu_has_any("avx512_vnni")


@pytest.mark.skipif(not VNNI, reason="this CPU has no AVX-512 VNNI: there is nothing to time")
def test_the_command_writes_json_the_figures_read(tmp_path, monkeypatch, capsys):
    from kvserve.bench.cli import main

    for name, value in SMALL.items():
        monkeypatch.setattr(gguf_vnni, name.upper(), value)
    path = tmp_path / "vnni.json"
    assert main(["bench", "gguf-vnni", "--rounds", "2", "--json", str(path)]) == 0
    assert "VNNI against AVX2" in capsys.readouterr().out
    data = json.loads(path.read_text())
    result = data["result"]
    assert data["machine"]["commit"] and result["baseline_build_flags"] == ["-mno-avx512f"]
    for fmt in SMALL["formats"]:
        for case in result["formats"][fmt].values():
            assert len(case["avx2_gmacs"]) == len(case["vnni_gmacs"]) == 2
            per_round = [v / a for a, v in zip(case["avx2_gmacs"], case["vnni_gmacs"])]
            assert case["vnni_over_avx2"]["per_round"] == pytest.approx(per_round)
    res = Result(Path("docs/results/vnni.json"), data)
    assert res.kind == "gguf_vnni"
    lines = LINES_OF["gguf_vnni"](res, "docs")
    table = [line for line in lines if line.startswith("| Q")]
    assert len(table) == 6 and table[0].startswith("| Q5_K, 1 row, cache | ")
    assert "`-mno-avx512f`" in lines[-1] and "`bench gguf-vnni`, 2 rounds, " in lines[-1]


def test_a_cpu_without_vnni_is_told_there_is_nothing_to_compare(monkeypatch):
    from kvserve.kernels import build

    monkeypatch.setattr(build, "cpu_has_any", lambda *flags: False)
    with pytest.raises(ValueError, match="no AVX-512 VNNI"):
        gguf_vnni.run_gguf_vnni_bench(1, **SMALL)

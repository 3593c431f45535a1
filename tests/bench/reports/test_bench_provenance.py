"""Every result carries its code's commit; docs/results/ takes results of committed code only."""
from __future__ import annotations

import subprocess

import pytest

from kvserve.bench.reports import provenance, report


def test_machine_info_names_the_code_and_the_cpus():
    info = report.machine_info()
    for key in ("commit", "tree_dirty", "date_utc", "cpu_model", "cpu_flags", "process_cpus",
                "torch_version", "transformers_version", "kvserve_version"):
        assert key in info
    if provenance.REPO_ROOT is not None:  # a checkout, as in CI
        head = subprocess.run(["git", "-C", str(provenance.REPO_ROOT), "rev-parse", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        assert info["commit"] == head and isinstance(info["tree_dirty"], bool)
    assert "commit" in report.machine_line(info)


@pytest.mark.skipif(provenance.REPO_ROOT is None, reason="kvserve is not run from a checkout")
def test_docs_results_refused_from_a_dirty_tree(tmp_path, monkeypatch):
    results = provenance.REPO_ROOT / "docs" / "results" / "new-figure.json"
    monkeypatch.setattr(provenance, "_dirty_paths", lambda ignore=None: ["kvserve/engine/llm.py"])
    with pytest.raises(provenance.DirtyTreeError, match="kvserve/engine/llm.py"):
        report.write_json(results, {"x": 1})
    assert not results.exists()
    report.write_json(tmp_path / "elsewhere.json", {"x": 1})  # outside docs/results: fine
    monkeypatch.setattr(provenance, "_dirty_paths", lambda ignore=None: [])
    provenance.check_results_target(results)  # a clean tree may write there


@pytest.mark.skipif(provenance.REPO_ROOT is None, reason="kvserve is not run from a checkout")
def test_the_bench_command_refuses_before_it_runs(monkeypatch):
    from kvserve.bench.cli import main

    monkeypatch.setattr(provenance, "_dirty_paths", lambda ignore=None: ["README.md"])
    target = provenance.REPO_ROOT / "docs" / "results" / "roofline-new.json"
    with pytest.raises(provenance.DirtyTreeError, match="commit them first"):
        main(["bench", "roofline", "--json", str(target), "--ms", "1", "--cube", "0"])

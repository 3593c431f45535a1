"""``kvserve bench memory``: every kv-manager x batching under one KV budget."""
from __future__ import annotations

import json

import pytest

from kvserve.bench.cli import main
from kvserve.bench.memory import combos, parse_kv_budget, run_combo
from kvserve.bench.workloads import mixed_workload, random_workload

KEYS = {"kv_manager", "batching", "kv_utilization", "internal_fragmentation",
        "external_fragmentation", "peak_running", "preemptions", "output_tok_s",
        "p99_latency_s"}


def test_kv_budget_forms():
    wl = random_workload(100, num_requests=4, input_len=30, output_len=10)  # 160 tokens
    assert parse_kv_budget("50%", wl, 4) == 20
    assert parse_kv_budget("64tokens", wl, 4) == 16
    assert parse_kv_budget("7blocks", wl, 4) == 7
    assert parse_kv_budget("1KiB", wl, 4, bytes_per_block=256) == 4
    with pytest.raises(ValueError):
        parse_kv_budget("1KiB", wl, 4)


def test_dry_run_writes_json_markdown_and_plot(tmp_path, llama_dir, capsys):
    out = tmp_path / "mem.json"
    rc = main(["bench", "memory", "--model", llama_dir, "--dry-run", "--num-prompts", "40",
               "--json", str(out), "--plot", str(tmp_path / "mem.png")])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["results"]
    assert [(r["kv_manager"], r["batching"]) for r in rows] == list(combos())
    for r in rows:
        assert KEYS <= set(r)
        assert 0 < r["kv_utilization"] <= 1 and r["output_tok_s"] is None
    paged = [r for r in rows if r["kv_manager"] == "paged"]
    assert all(r["external_fragmentation"] == 0 for r in paged)
    assert all(r["kv_utilization"] > 0.95 for r in paged)
    assert all(r["peak_running"] <= 16 for r in rows if r["batching"] == "static")
    md = (tmp_path / "mem.md").read_text()
    assert "| paged | continuous |" in md and "KV utilisation" in md
    assert (tmp_path / "mem.png").stat().st_size > 10_000


def test_dry_run_on_the_mixed_workload_meets_the_paged_target():
    """Block 16, the full mixed workload, a quarter of what it holds at once."""
    wl = mixed_workload(8192, num_requests=128)
    blocks = parse_kv_budget("25%", wl, 16)
    res = run_combo(None, wl.requests, "paged", "continuous", blocks, dry_run=True)
    assert res.kv_utilization >= 0.98
    assert res.preemptions > 0  # the budget really binds


def test_real_run_measures_throughput_and_latency(llama_dir):
    wl = random_workload(400, num_requests=6, input_len=20, output_len=5)
    res = run_combo(llama_dir, wl.requests, "buddy", "static", 12,
                    {"block_size": 4, "max_batch_size": 4})
    assert res.output_tok_s > 0 and res.p99_latency_s > 0
    assert res.peak_running <= 4 and res.steps > 0

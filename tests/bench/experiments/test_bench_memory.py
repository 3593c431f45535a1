"""``kvserve bench memory``: every kv-manager x batching under one KV budget."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvserve.bench.cli import main
from kvserve.bench.experiments.memory import MemoryResult, combine_rounds, combos, \
    format_markdown, parse_kv_budget, run_combo
from kvserve.bench.instruments.paired import PairedRatio
from kvserve.bench.reports.report import to_jsonable
from kvserve.bench.workloads.definitions import mixed_workload, random_workload

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


def test_relative_tok_s_is_the_median_of_the_rounds_ratios():
    wl = random_workload(100, num_requests=4, input_len=30, output_len=10)
    dry = run_combo(None, wl.requests, "paged", "continuous", 40, dry_run=True)

    def measured(batching: str, tok_s: float) -> MemoryResult:
        return replace(dry, batching=batching, output_tok_s=tok_s, wall_s=1.0)
    # each round: the first combination, then another; the other's over the first's by
    # round 2, 2, 6 (median 2), where the medians' ratio is 40 / 10
    rounds = [[measured("continuous", a), measured("static", b)]
              for a, b in ((10.0, 20.0), (20.0, 40.0), (10.0, 60.0))]
    first, other = combine_rounds(rounds)
    assert first.relative_tok_s == PairedRatio(1.0, 1.0, 1.0, 3, (1.0, 1.0, 1.0))
    assert other.relative_tok_s == PairedRatio(2.0, 2.0, 6.0, 3, (2.0, 2.0, 6.0))
    assert other.output_tok_s == 40.0
    md = format_markdown([first, other])
    assert "| 2.00x (2.00–6.00) |" in md
    assert "output tok/s ratio (paged): static 2.00x (2.00–6.00) > continuous" in md
    saved = json.loads(json.dumps(to_jsonable(other)))["relative_tok_s"]
    assert saved == {"median": 2.0, "min": 2.0, "max": 6.0, "rounds": 3,
                     "per_round": [2.0, 2.0, 6.0]}


def test_a_windowed_model_compares_paged_memory_with_and_without_kv_groups(tmp_path,
                                                                            model_dirs):
    """Gemma 2's layout: in the same bytes, paged memory with a table per KV group holds
    less KV per request than keeping every layer's, once prompts pass the window."""
    out = tmp_path / "mem.json"
    rc = main(["bench", "memory", "--model", model_dirs("gemma2"), "--dry-run",
               "--workload", "random", "--input-len", "200", "--output-len", "20",
               "--num-prompts", "6", "--kv-managers", "paged,buddy",
               "--batchings", "continuous", "--kv-budget", "60%", "--json", str(out)])
    assert rc == 0
    rows = {r["kv_manager"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"paged", "paged-no-hybrid", "buddy"}
    grouped, whole = rows["paged"], rows["paged-no-hybrid"]
    assert grouped["num_blocks"] == 2 * whole["num_blocks"]  # half the layers a block
    assert grouped["kv_mib_per_request"] < 0.8 * whole["kv_mib_per_request"]
    assert grouped["preemptions"] <= whole["preemptions"]

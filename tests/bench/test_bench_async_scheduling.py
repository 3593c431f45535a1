"""``kvserve bench async-scheduling``: two kvserve servers that differ only in the flag,
each measured in every round of both loads, the idle one paused."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.bench.async_scheduling import MODES, run_async_scheduling_bench
from kvserve.bench.server_process import server_flags
from kvserve.bench.workloads import BenchRequest
from tests.bench.conftest import record_served


def test_bools_become_flag_or_no_flag():
    assert server_flags({"async_scheduling": True, "huge_pages": False, "max_num_seqs": 4}) \
        == ["--async-scheduling", "--no-huge-pages", "--max-num-seqs=4"]


def test_both_servers_every_round_of_both_loads(tiny_model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.bench import async_scheduling

    started: dict[str, object] = {}
    real_server = async_scheduling.ServerProcess

    def make(model_dir, state_dir, flags, log_path):
        mode = "async" if "--async-scheduling" in flags else "sync"
        assert ("--no-async-scheduling" in flags) == (mode == "sync")
        started[mode] = server = real_server(model_dir, state_dir, flags, log_path)
        return server
    monkeypatch.setattr(async_scheduling, "ServerProcess", make)
    served = record_served(monkeypatch, started)

    warmup = [BenchRequest([3, 4, 5], 2)] * 2
    rounds = [[BenchRequest([3 + i + 10 * r, 4, 5, 6], 6) for i in range(3)] for r in range(4)]
    lines: list[str] = []
    result = run_async_scheduling_bench(
        tiny_model_dir, warmup, {"low": (50.0, rounds[:2]), "high": (float("inf"), rounds[2:])},
        {"max_num_seqs": 4}, log=lines.append)
    assert served == [("sync", 2), ("async", 2),                 # warm-up, once
                      ("sync", 3), ("async", 3), ("async", 3), ("sync", 3),
                      ("sync", 3), ("async", 3), ("async", 3), ("sync", 3)]
    assert sum("round" in line for line in lines) == 4
    for load in ("low", "high"):
        res = result[load]
        assert res["kv_blocks"] > 0
        for mode in MODES:
            assert [r["completed"] for r in res["rounds"][mode]] == [3, 3]
        by_round = res["async_over_sync_by_round"]["tpot_median_ms"]
        assert by_round == pytest.approx([a["tpot_median_ms"] / s["tpot_median_ms"] for a, s in
                                          zip(res["rounds"]["async"], res["rounds"]["sync"])])
    for server in started.values():
        assert server.proc.poll() is not None


def test_the_flag_is_the_bench_s_own_and_one_process_is_paused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="sets async_scheduling itself"):
        run_async_scheduling_bench(tiny_model_dir, [], {}, {"async_scheduling": True})
    with pytest.raises(ValueError, match="without tensor parallelism"):
        run_async_scheduling_bench(tiny_model_dir, [], {}, {"tensor_parallel_size": 2})

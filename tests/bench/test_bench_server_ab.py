"""``kvserve bench server-ab``: two kvserve servers that differ only in one flag, each
measured in every round of both loads, the idle one paused."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.bench.server_ab import MODES, run_server_ab_bench
from kvserve.bench.server_process import server_flags
from kvserve.bench.workloads import BenchRequest
from tests.bench.conftest import record_served


def test_bools_become_flag_or_no_flag():
    assert server_flags({"async_scheduling": True, "huge_pages": False, "max_num_seqs": 4}) \
        == ["--async-scheduling", "--no-huge-pages", "--max-num-seqs=4"]


def test_both_servers_every_round_of_both_loads(tiny_model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.bench import server_ab

    started: dict[str, object] = {}
    real_server = server_ab.ServerProcess

    def make(model_dir, state_dir, flags, log_path):
        mode = "on" if "--async-scheduling" in flags else "off"
        assert ("--no-async-scheduling" in flags) == (mode == "off")
        started[mode] = server = real_server(model_dir, state_dir, flags, log_path)
        return server
    monkeypatch.setattr(server_ab, "ServerProcess", make)
    served = record_served(monkeypatch, started)

    warmup = [BenchRequest([3, 4, 5], 2)] * 2
    rounds = [[BenchRequest([3 + i + 10 * r, 4, 5, 6], 6) for i in range(3)] for r in range(4)]
    lines: list[str] = []
    result = run_server_ab_bench(
        tiny_model_dir, warmup, {"low": (50.0, rounds[:2]), "high": (float("inf"), rounds[2:])},
        {"max_num_seqs": 4}, "async_scheduling", log=lines.append)
    assert served == [("off", 2), ("on", 2),                     # warm-up, once
                      ("off", 3), ("on", 3), ("on", 3), ("off", 3),
                      ("off", 3), ("on", 3), ("on", 3), ("off", 3)]
    assert sum("round" in line for line in lines) == 4
    for load in ("low", "high"):
        res = result[load]
        assert res["kv_blocks"] > 0 and res["flag"] == "async_scheduling"
        for mode in MODES:
            assert [r["completed"] for r in res["rounds"][mode]] == [3, 3]
        by_round = res["on_over_off_by_round"]["tpot_median_ms"]
        assert by_round == pytest.approx([a["tpot_median_ms"] / s["tpot_median_ms"] for a, s in
                                          zip(res["rounds"]["on"], res["rounds"]["off"])])
    for server in started.values():
        assert server.proc.poll() is not None


def test_the_flag_is_a_bool_setting_the_bench_sets_itself(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="sets huge_pages itself"):
        run_server_ab_bench(tiny_model_dir, [], {}, {"huge_pages": True}, "huge_pages")
    with pytest.raises(ValueError, match="not a boolean engine setting.*async_scheduling"):
        run_server_ab_bench(tiny_model_dir, [], {}, {}, "max_num_seqs")
    with pytest.raises(ValueError, match="without tensor parallelism"):
        run_server_ab_bench(tiny_model_dir, [], {}, {"tensor_parallel_size": 2}, "huge_pages")

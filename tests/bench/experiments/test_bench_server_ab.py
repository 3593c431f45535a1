"""``kvserve bench server-ab``: two kvserve servers that differ only in one flag, each
measured in every round of both loads, the idle one paused."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvserve.bench.experiments.server_ab import MODES, run_server_ab_bench
from kvserve.bench.experiments.serving import RATIO_KEYS
from kvserve.bench.instruments.paired import PairedRatio, paired_ratio
from kvserve.bench.peers.server_process import server_flags
from kvserve.bench.workloads.definitions import BenchRequest
from tests.bench.conftest import record_served


def test_bools_become_flag_or_no_flag():
    assert server_flags({"async_scheduling": True, "huge_pages": False, "max_num_seqs": 4}) \
        == ["--async-scheduling", "--no-huge-pages", "--max-num-seqs=4"]


@pytest.mark.slow  # (15-25 s: `make test` stays near 10 minutes)
def test_both_servers_every_round_of_both_loads(tiny_model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.bench.experiments import server_ab

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
        by_round = res["on_over_off"]["tpot_median_ms"].per_round
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


def _round(figure: float) -> dict:
    """A round's summary in which every latency and the output rate are ``figure``."""
    return {"completed": 3, "failed": 0, "output_tok_s": figure,
            **{key: figure for key in RATIO_KEYS}}


def test_on_over_off_is_the_median_of_the_rounds_ratios(tiny_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.bench.experiments import server_ab

    class FakeServer:
        def __init__(self, model_dir, state_dir, flags, log_path) -> None:
            self.proc = SimpleNamespace(send_signal=lambda sig: None)

        def close(self) -> None:
            pass
    # on over off by round 2, 2, 6 (median 2); the medians' ratio is 40 / 10
    runs = {"on": [_round(20.0), _round(40.0), _round(60.0)],
            "off": [_round(10.0), _round(20.0), _round(10.0)]}
    monkeypatch.setattr(server_ab, "ServerProcess", FakeServer)
    monkeypatch.setattr(server_ab, "_kv_blocks", lambda server: 64)
    monkeypatch.setattr(server_ab, "serve_alternating", lambda *args: runs)
    result = run_server_ab_bench(tiny_model_dir, [], {"low": (1.0, [[]] * 3)}, {},
                                 "async_scheduling", log=lambda line: None)
    on_over_off = result["low"]["on_over_off"]
    assert set(on_over_off) == {*RATIO_KEYS, "output_tok_s"}
    for ratio in on_over_off.values():
        assert ratio == PairedRatio(2.0, 2.0, 6.0, 3, (2.0, 2.0, 6.0))


def test_the_command_prints_and_saves_the_paired_ratios(tiny_model_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys) -> None:
    from kvserve.bench.experiments import server_ab
    from kvserve.cli import main

    on, off = [_round(20.0), _round(40.0), _round(60.0)], [_round(10.0), _round(20.0),
                                                          _round(10.0)]
    ratio = paired_ratio([r["output_tok_s"] for r in on], [r["output_tok_s"] for r in off])

    def bench(model_dir, warmup, loads, engine_args, flag):
        return {name: {"rounds": {"on": on, "off": off},
                       "on_over_off": {"output_tok_s": ratio}} for name in loads}
    monkeypatch.setattr(server_ab, "run_server_ab_bench", bench)
    assert main(["bench", "server-ab", "--model", str(tiny_model_dir), "--flag",
                 "async-scheduling", "--workload", "random", "--num-prompts", "2",
                 "--input-len", "8", "--output-len", "3", "--rounds", "3",
                 "--json", str(tmp_path / "ab.json")]) == 0
    printed = capsys.readouterr().out
    assert "output_tok_s: 2.00x (median of 3 rounds' ratios; 2.00–6.00)" in printed
    saved = json.loads((tmp_path / "ab.json").read_text())["result"]
    assert all(load["on_over_off"]["output_tok_s"]["per_round"] == [2.0, 2.0, 6.0]
               for load in saved.values())

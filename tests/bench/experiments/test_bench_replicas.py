"""``kvserve bench replicas``' ingress cost, with stand-in servers: the plain server and
``--replicas 1`` alternate by round, and their ratio is the median of the rounds' ratios,
a round with a failed request dropped."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.bench.experiments import replicas
from kvserve.bench.instruments.paired import PairedRatio, summarize_ratios
from kvserve.cli import main


class _FakeServer:
    def __init__(self, model_dir, state_dir, flags, log_path) -> None:
        self.name = "replicas_1" if "--replicas" in flags else "plain"
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_ingress_cost_is_the_median_of_the_rounds_ratios(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # useful tok/s by round after each server's untimed pass; replicas 1 over plain
    # 2, 2, (round 3 failed on plain), 6: median 2, where the medians' ratio is 50 / 15
    figures = {"plain": iter([1.0, 10.0, 20.0, 30.0, 10.0]),
               "replicas_1": iter([1.0, 20.0, 40.0, 90.0, 60.0])}
    failed = {"plain": iter([0, 0, 0, 1, 0]), "replicas_1": iter([0, 0, 0, 0, 0])}
    served, servers = [], []

    def make(*args):
        servers.append(_FakeServer(*args))
        return servers[-1]

    def serve_round(server, requests, rate, seed):
        served.append(server.name)
        return {"useful_tok_s": next(figures[server.name]), "completed": 4,
                "failed": next(failed[server.name])}
    monkeypatch.setattr(replicas, "ServerProcess", make)
    monkeypatch.setattr(replicas, "_serve_round", serve_round)
    cost = replicas.ingress_cost(tmp_path, tmp_path, [], [], rounds=4)
    assert served == ["plain", "replicas_1",  # the untimed pass
                      "plain", "replicas_1", "replicas_1", "plain",
                      "plain", "replicas_1", "replicas_1", "plain"]
    assert cost["replicas_1_over_plain"] == PairedRatio(2.0, 2.0, 6.0, 3, (2.0, 2.0, 6.0))
    assert all(server.closed for server in servers)


def test_the_command_prints_and_saves_the_paired_ratio(tiny_model_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys) -> None:
    cost = {"rounds": {}, "replicas_1_over_plain": summarize_ratios([0.9, 0.95, 0.8])}
    routed = {"single_engine": {"prefix_hit_rate": 0.5, "hit_rate_vs_single": 1.0}}
    monkeypatch.setattr(replicas, "ingress_cost", lambda *args: cost)
    monkeypatch.setattr(replicas, "routing", lambda *args: routed)
    assert main(["bench", "replicas", "--model", str(tiny_model_dir), "--num-prompts", "2",
                 "--prefix-requests", "4", "--num-prefixes", "2",
                 "--json", str(tmp_path / "r.json")]) == 0
    assert "0.90x (0.80–0.95)  median of 3 rounds' ratios" in capsys.readouterr().out
    saved = json.loads((tmp_path / "r.json").read_text())["ingress_cost"]
    assert saved["replicas_1_over_plain"]["per_round"] == [0.9, 0.95, 0.8]

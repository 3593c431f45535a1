"""``kvserve bench spec`` and ``bench structured`` store and print the median of the
rounds' ratios, not the ratio of each side's median (stand-in engines: no model runs)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvserve.bench.instruments.paired import PairedRatio, summarize_ratios
from kvserve.cli import main

# each side's tok/s by round: on over off 2, 2, 6 (median 2); the medians' ratio is 4
ON_TOK_S, OFF_TOK_S = [20.0, 40.0, 60.0], [10.0, 20.0, 10.0]


class _StepCost:
    """The speculator's start-up step cost: a step of ``rows`` rows takes ``rows`` ms."""

    rows, seconds = [1, 2], [0.001, 0.002]

    def __call__(self, rows: int) -> float:
        return rows / 1000


def test_spec_bench_pairs_on_and_off_by_round(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvserve
    from kvserve.bench.experiments import spec

    class FakeLLM:
        def __init__(self, model, speculative_config=None, **engine_args) -> None:
            self.engine = SimpleNamespace(speculator=SimpleNamespace(cost=_StepCost()),
                                          settle=lambda: None)
            self.speculating = speculative_config is not None

    rates = {True: iter([1.0] + ON_TOK_S), False: iter([1.0] + OFF_TOK_S)}  # warm-up first
    order = []

    def run(llm, requests, single_stream):
        order.append("on" if llm.speculating else "off")
        return spec.SpecRun(output_tokens=100, seconds=100 / next(rates[llm.speculating]))
    monkeypatch.setattr(kvserve, "LLM", FakeLLM)
    monkeypatch.setattr(spec, "_run", run)
    result = spec.run_spec_bench(None, [object()], {"method": "ngram"}, {}, 3, True,
                                 log=lambda line: None)
    assert order == ["off", "on", "off", "on", "on", "off", "off", "on"]  # alternating
    assert result["speedup"] == PairedRatio(2.0, 2.0, 6.0, 3, (2.0, 2.0, 6.0))
    assert (result["on_tok_s"], result["off_tok_s"]) == (40.0, 10.0)
    assert "round_ratios" not in result


def test_structured_bench_pairs_constrained_and_plain_by_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvserve
    from kvserve.bench.experiments import structured

    clock = [0.0]
    rates = {"constrained": iter(ON_TOK_S), "plain": iter(OFF_TOK_S)}
    order = []

    class FakeLLM:
        def __init__(self, model) -> None:
            self.engine = SimpleNamespace(
                structured=SimpleNamespace(mask_seconds=0.0, masked_rows=0),
                worker=SimpleNamespace(runner=SimpleNamespace(mask_wait_seconds=0.0)))
            self.warmed = False

        def generate(self, prompts, params, use_tqdm):
            outs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * 5)])
                    for _ in prompts]
            if not self.warmed:  # the schema's warm-up run, untimed
                self.warmed = True
                return outs
            kind = "constrained" if params.structured_outputs else "plain"
            order.append(kind)
            clock[0] += 5 * len(prompts) / next(rates[kind])
            return outs
    monkeypatch.setattr(kvserve, "LLM", FakeLLM)
    monkeypatch.setattr(structured, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    result = structured.run_structured_bench(None, 4, 5, 3, log=lambda line: None)
    assert order == ["plain", "constrained", "constrained", "plain", "plain", "constrained"]
    assert result["ratio"].per_round == pytest.approx((2.0, 2.0, 6.0))
    assert result["ratio"].median == pytest.approx(2.0)  # not the medians' 40 / 10
    assert result["constrained_tok_s"] == pytest.approx(40.0)
    assert result["plain_tok_s"] == pytest.approx(10.0)
    assert "round_ratios" not in result


def test_spec_command_prints_and_saves_the_paired_speedup(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from kvserve.bench.experiments import spec

    canned = {"off_tok_s": 10.0, "on_tok_s": 20.0, "speedup": summarize_ratios([1.5, 1.2, 3.0]),
              "acceptance_rate": 0.5, "mean_acceptance_length": 2.0,
              "verify_cost_vs_one_row": {1: 1.1}}
    monkeypatch.setattr(spec, "run_spec_bench", lambda *args: dict(canned))
    rc = main(["bench", "spec", "--model", str(tiny_model_dir), "--workload", "random",
               "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
               "--json", str(tmp_path / "spec.json")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "1.50x (1.20–3.00)" in printed
    assert "speed-up, on / off: 1.50x (median of 3 rounds' ratios; 1.20–3.00)" in printed
    saved = json.loads((tmp_path / "spec.json").read_text())["result"]["speedup"]
    assert saved == {"median": 1.5, "min": 1.2, "max": 3.0, "rounds": 3,
                     "per_round": [1.5, 1.2, 3.0]}


def test_structured_command_prints_and_saves_the_paired_ratio(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from kvserve.bench.experiments import structured

    canned = {"plain_tok_s": 10.0, "constrained_tok_s": 9.0,
              "ratio": summarize_ratios([0.8, 0.95]), "mask_us_per_token": 3.0,
              "mask_share_of_run": 0.01, "mask_wait_share_of_run": 0.0}
    monkeypatch.setattr(structured, "run_structured_bench", lambda *args: dict(canned))
    assert main(["bench", "structured", "--json", str(tmp_path / "s.json")]) == 0
    printed = capsys.readouterr().out
    assert ("json_schema / unconstrained tok/s: 0.88x (median of 2 rounds' ratios; "
            "0.80–0.95)") in printed
    saved = json.loads((tmp_path / "s.json").read_text())["result"]["ratio"]
    assert saved["median"] == pytest.approx(0.875) and saved["rounds"] == 2

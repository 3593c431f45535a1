"""kvserve tune: the simulated-clock replay, pruning, the Pareto front, the CLI's files."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from kvserve.bench.workloads.definitions import BenchRequest
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.tune.replay import replay
from kvserve.tune.search import Slos, Trial, Tuner, engine_args_of, pareto_front


def _requests(n=4):
    return [BenchRequest(list(range(5 + i, 25 + i)), 6) for i in range(n)]


def test_replay_counts_idle_gaps_on_the_simulated_clock(llama_dir):
    engine = LLMEngine(EngineArgs(model=llama_dir, num_threads=1))
    result = replay(engine, _requests(3), [0.0, 100.0, 200.0])
    assert result.complete and result.output_tokens == 18
    assert len(result.ttft_s) == 3 and len(result.tpot_s) == 3
    assert 200.0 < result.duration_s < 200.0 + 10 * result.compute_s + 1
    assert result.compute_s < 30  # the gaps were not waited for
    assert all(0 < t < 100 for t in result.ttft_s)


def test_a_closed_loop_keeps_the_concurrency(llama_dir):
    engine = LLMEngine(EngineArgs(model=llama_dir, num_threads=1))
    result = replay(engine, _requests(5), None, concurrency=2)
    assert result.complete and result.output_tokens == 30 and result.peak_running <= 2
    assert len(result.ttft_s) == 5


def test_replay_stops_at_its_deadline(llama_dir):
    engine = LLMEngine(EngineArgs(model=llama_dir, num_threads=1))
    result = replay(engine, _requests(4), [0.0] * 4, deadline_s=0.0)
    assert not result.complete and result.steps == 1


def test_candidate_settings_become_engine_args():
    args = engine_args_of({"kv_manager": "buddy", "num_speculative_tokens": 2,
                           "max_num_seqs": 8})
    assert args == {"kv_manager": "buddy", "enable_prefix_caching": False, "max_num_seqs": 8,
                    "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    EngineArgs(**args)  # valid as they are


def test_the_cost_model_prunes_what_cannot_meet_the_slos():
    tuner = object.__new__(Tuner)
    tuner.space = {"max_num_seqs": [8, 64, 256], "max_num_batched_tokens": [256, 4096]}
    tuner.slos = Slos(ttft_s=0.1, tpot_s=0.02)
    tuner.step_cost = {1: 0.005, 8: 0.006, 64: 0.015, 128: 0.03, 256: 0.06}
    tuner.log = lambda _: None
    assert tuner._prune() == {"max_num_seqs": [256], "max_num_batched_tokens": [4096]}
    assert tuner.space == {"max_num_seqs": [8, 64], "max_num_batched_tokens": [256]}
    assert abs(tuner._cost(4096) - (0.06 + 3840 * 0.03 / 128)) < 1e-9  # extrapolated


def test_pareto_front():
    a = Trial({"a": 1}, throughput=100, p99_ttft_ms=50, p99_tpot_ms=10)
    b = Trial({"b": 1}, throughput=90, p99_ttft_ms=60, p99_tpot_ms=12)   # worse than a
    c = Trial({"c": 1}, throughput=80, p99_ttft_ms=20, p99_tpot_ms=12)   # lower TTFT
    d = Trial({"d": 1}, error="failed")
    assert pareto_front([a, b, c, d]) == [a, c]


def _tune(llama_dir, tmp_path, budget_s: str, *extra: str) -> subprocess.CompletedProcess:
    """``kvserve tune`` on six short requests of the tiny model."""
    workload = tmp_path / "workload.jsonl"
    workload.write_text("\n".join(json.dumps({"prompt_token_ids": r.prompt_token_ids,
                                               "max_tokens": r.max_tokens})
                                   for r in _requests(6)))
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "tune", llama_dir, "--workload",
         str(workload), "--num-prompts", "6", "--request-rate", "20", "--slo-ttft-ms",
         "2000", "--slo-tpot-ms", "500", "--budget-s", budget_s, "--kv-cache-memory",
         "64MiB", "--out", str(tmp_path / "tuned.yaml"), *extra],
        capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def least_budget_s(llama_dir, tmp_path_factory) -> int:
    """The least budget kvserve tune names when refusing one too small, on this machine
    as busy as it is now (half a second: the first replay is cut at once, so it names a
    bound: more than N s)."""
    tmp_path = tmp_path_factory.mktemp("refused")
    done = _tune(llama_dir, tmp_path, "0.5")
    assert done.returncode == 2, done.stderr[-3000:]
    refused = re.search(r"kvserve: error: --budget-s 0.5 is too small for one trial: .* "
                        r"need (?:at least|more than) (\d+) s in all\. Give --budget-s "
                        r"(?:over )?(\d+)", done.stderr)
    assert refused, done.stderr[-3000:]
    assert refused.group(1) == refused.group(2)
    assert not (tmp_path / "tuned.yaml").exists()  # refused before anything was written
    return int(refused.group(1))


def test_tune_refuses_a_budget_too_small_naming_the_least_that_would_do(least_budget_s):
    assert least_budget_s >= 1  # the refusal's own checks are the fixture's


def test_tune_writes_settings_front_and_plot_within_its_budget(llama_dir, tmp_path,
                                                               least_budget_s):
    """Given twice the least budget it named when refusing one too small, the run
    searches and writes every file, and ends within that budget (5 % allowed). Loading
    counts, and it takes what the machine's load lets it: if that grew so much that the
    run is refused again, it is given twice the new least once more."""
    out, js, png = tmp_path / "tuned.yaml", tmp_path / "tune.json", tmp_path / "front.png"
    plan = tmp_path / "plan.json"
    budget = 2 * least_budget_s
    for _ in range(2):
        done = _tune(llama_dir, tmp_path, str(budget), "--plot", str(png), "--json",
                     str(js), "--tuning-plan", str(plan))
        again = re.search(r"is too small for one trial: .* need (?:at least|more than) "
                          r"(\d+) s", done.stderr)
        if done.returncode != 2 or not again:
            break
        budget = 2 * int(again.group(1))
    assert done.returncode == 0, done.stderr[-3000:]
    took = re.search(rf"took ([0-9.]+) s of a {budget} s budget", done.stdout)
    assert took and float(took.group(1)) <= budget * 1.05, done.stdout[-2000:]
    settings = yaml.safe_load(out.read_text())
    assert isinstance(settings, dict)
    EngineArgs(model=llama_dir, **settings)  # LLM(**yaml) reads the file as it is
    # the best settings' tuning plan, named by the settings, for the same threads
    assert settings["tuning_plan"] == str(plan.resolve())
    saved = json.loads(plan.read_text())
    assert saved["key"]["threads"] == settings.get("num_threads", saved["key"]["threads"])
    from kvserve.cli import build_parser
    args = build_parser().parse_args(["serve", llama_dir, "--config", str(out)])
    for key, value in settings.items():  # and so does kvserve serve --config
        assert getattr(args, key) == value or key == "speculative_config", key
    report = json.loads(js.read_text())
    assert len(report["trials"]) >= 2 and report["trials"][0]["settings"] == {}
    assert report["pareto_front"] and report["gain_vs_defaults"] > 0
    assert report["seconds"] <= budget * 1.05
    assert png.stat().st_size > 10_000
    assert "candidates measured" in done.stdout

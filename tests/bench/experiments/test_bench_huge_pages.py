"""``kvserve bench huge-pages`` on a tiny model: one engine each way, both timed and
their memory's streaming read measured in every round, figures derived from what was
measured, and what it cannot compare refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.bench.experiments import huge_pages as bench
from kvserve.bench.instruments.paired import PairedRatio
from kvserve.bench.workloads.definitions import BenchRequest
from kvserve.engine.llm_engine import LLMEngine
from kvserve.cli import main
from kvserve.worker.huge_pages import huge_pages_setting

needs_thp = pytest.mark.skipif(
    huge_pages_setting() != "madvise",
    reason=f"the bench needs transparent huge pages in 'madvise' mode, here "
           f"'{huge_pages_setting()}'")


def _requests(n: int, length: int) -> list[BenchRequest]:
    return [BenchRequest([3 + (i * 7 + j) % 60 for j in range(length + i % 3)], 8)
            for i in range(n)]


@pytest.fixture
def short_runs(monkeypatch):
    monkeypatch.setattr(bench, "PROMPT_TOKENS", 24)
    monkeypatch.setattr(bench, "NEW_TOKENS", 5)


@needs_thp
def test_both_engines_are_timed_and_the_figures_follow(tiny_model_dir: Path, monkeypatch,
                                                       short_runs) -> None:
    steps_by_engine: dict[bool, int] = {True: 0, False: 0}
    real_step = LLMEngine.step

    def counted(self):
        steps_by_engine[self.worker.huge_pages] += 1
        return real_step(self)
    monkeypatch.setattr(LLMEngine, "step", counted)
    kinds = []
    import kvserve.bench.instruments.roofline as roofline
    monkeypatch.setattr(roofline, "measure_apart",
                        lambda name, huge_pages=False: kinds.append(huge_pages) or
                        (20.0 if huge_pages else 10.0))
    lines: list[str] = []
    result = bench.run_huge_pages_bench(str(tiny_model_dir), _requests(40, 24), {}, rounds=2,
                                        log=lines.append)
    assert steps_by_engine[True] == steps_by_engine[False] > 0  # the same work each way
    assert sorted(kinds) == [False, False, True, True]  # each kind once a round
    assert result["round_sum_bandwidth_gbs"] == {"huge": [20.0, 20.0], "torch": [10.0, 10.0]}
    assert result["sum_bandwidth_ratio"].per_round == (2.0, 2.0)
    tok = result["round_workload_tok_s"]
    assert len(tok["huge"]) == len(tok["torch"]) == 2 and min(tok["huge"] + tok["torch"]) > 0
    assert result["workload_speedup"].per_round == pytest.approx(
        [h / t for h, t in zip(tok["huge"], tok["torch"])])
    assert sum("round" in line for line in lines) == 2
    for c in bench.CONCURRENCY:
        for mode in bench.MODES:
            assert len(result["round_step_ms"][mode][c]) == 2
        assert result["speedup"][c].per_round == pytest.approx(
            [t / h for t, h in zip(result["round_step_ms"]["torch"][c],
                                   result["round_step_ms"]["huge"][c])])


def test_huge_pages_against_torchs_is_the_median_of_the_rounds_ratios() -> None:
    # torch's step over huge pages' by round 2, 2, 6 (median 2); the medians' ratio is 4
    runs = {"torch": {c: [0.002, 0.004, 0.006] for c in bench.CONCURRENCY},
            "huge": {c: [0.001, 0.002, 0.001] for c in bench.CONCURRENCY}}
    tok_s = {"huge": [30.0, 60.0, 20.0], "torch": [10.0, 30.0, 20.0]}  # 3, 2, 1
    bandwidth = {"huge": [20.0, 40.0, 60.0], "torch": [10.0, 20.0, 10.0]}  # 2, 2, 6
    figures = bench.huge_over_torch(runs, tok_s, bandwidth)
    for c in bench.CONCURRENCY:
        assert figures["step_ms"]["torch"][c] == pytest.approx(4.0)
        assert figures["step_ms"]["huge"][c] == pytest.approx(1.0)
        assert figures["speedup"][c] == PairedRatio(2.0, 2.0, 6.0, 3, (2.0, 2.0, 6.0))
    assert figures["workload_speedup"] == PairedRatio(2.0, 1.0, 3.0, 3, (3.0, 2.0, 1.0))
    assert figures["sum_bandwidth_ratio"].median == 2.0  # the medians' ratio: 40 / 10


@needs_thp
@pytest.mark.parametrize("engine_args, match", [
    ({"huge_pages": False}, "sets --huge-pages itself"),
    ({"tensor_parallel_size": 2}, "without tensor parallelism"),
])
def test_settings_it_cannot_compare_are_refused(tiny_model_dir: Path, short_runs, engine_args,
                                                match) -> None:
    with pytest.raises(ValueError, match=match):
        bench.run_huge_pages_bench(str(tiny_model_dir), _requests(40, 24), engine_args,
                                   rounds=1)


def test_thp_always_leaves_no_baseline(tiny_model_dir: Path, monkeypatch) -> None:
    import kvserve.worker.huge_pages as hp
    monkeypatch.setattr(hp, "huge_pages_setting", lambda: "always")
    monkeypatch.setattr(hp, "huge_pages_available", lambda: True)
    with pytest.raises(ValueError, match="'always' here: torch's large allocations get huge"):
        bench.run_huge_pages_bench(str(tiny_model_dir), _requests(40, 24), {}, rounds=1)


def test_a_kernel_without_huge_pages_is_refused(tiny_model_dir: Path, monkeypatch) -> None:
    import kvserve.worker.huge_pages as hp
    monkeypatch.setattr(hp, "huge_pages_setting", lambda: "never")
    monkeypatch.setattr(hp, "huge_pages_available", lambda: False)
    with pytest.raises(ValueError, match=r"no transparent huge pages here \(never\)"):
        bench.run_huge_pages_bench(str(tiny_model_dir), _requests(40, 24), {}, rounds=1)


@needs_thp
def test_too_few_long_prompts_are_refused(tiny_model_dir: Path, short_runs) -> None:
    with pytest.raises(ValueError, match="32 requests of at least 24 prompt tokens; it has 5"):
        bench.run_huge_pages_bench(str(tiny_model_dir), _requests(5, 24) + _requests(40, 10),
                                   {}, rounds=1)


@needs_thp
def test_both_engines_capture_the_same_rows(tiny_model_dir: Path, monkeypatch,
                                            short_runs) -> None:
    from kvserve.worker import captured_step
    from kvserve.worker.tuning import tuner
    chosen = iter([5, 3])  # what each engine's start-up timing would have chosen

    def choose(runner, captured, rounds=5):
        captured.max_rows = next(chosen)
        return {}
    monkeypatch.setattr(tuner, "choose_captured_rows", choose)
    seen = []
    real = captured_step.CapturedStep.covers
    monkeypatch.setattr(captured_step.CapturedStep, "covers",
                        lambda self, i: seen.append(self.max_rows) or real(self, i))
    # from the engines' start on (the log line), every step sees the common rows
    result = bench.run_huge_pages_bench(str(tiny_model_dir), _requests(40, 24), {}, rounds=1,
                                        log=lambda line: "ready" in line and seen.clear())
    assert result["captured_rows"] == 3
    assert seen and set(seen) == {3}


def test_the_command_prints_and_saves_the_paired_ratios(tiny_model_dir: Path, tmp_path: Path,
                                                       monkeypatch, capsys) -> None:
    runs = {"torch": {c: [0.002, 0.004, 0.006] for c in bench.CONCURRENCY},
            "huge": {c: [0.001, 0.002, 0.001] for c in bench.CONCURRENCY}}
    tok_s = {"huge": [30.0, 60.0, 20.0], "torch": [10.0, 30.0, 20.0]}
    bandwidth = {"huge": [20.0, 40.0, 60.0], "torch": [10.0, 20.0, 10.0]}
    figures = bench.huge_over_torch(runs, tok_s, bandwidth)
    monkeypatch.setattr(bench, "run_huge_pages_bench", lambda *args: figures)
    assert main(["bench", "huge-pages", "--model", str(tiny_model_dir), "--workload", "random",
                 "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                 "--json", str(tmp_path / "hp.json")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("2.00x (2.00–6.00)") == len(bench.CONCURRENCY)  # the table's rows
    assert ("huge pages over torch's 2.00x (median of 3 rounds' ratios; 1.00–3.00)"
            in printed)
    assert ("streaming read, huge pages over torch's: 2.00x (median of 3 rounds' ratios; "
            "2.00–6.00)") in printed
    saved = json.loads((tmp_path / "hp.json").read_text())["result"]
    assert saved["speedup"]["1"]["per_round"] == [2.0, 2.0, 6.0]

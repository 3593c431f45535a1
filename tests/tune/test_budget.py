"""--budget-s is a promise: the search, the final re-measurement and the report end
within it, or the run is refused before the search, naming the least budget that would
do. Checked on a fake clock with fake replay costs: the search loop, optuna and the
final re-measurement run as they do, only the candidates' replays are simulated."""
from __future__ import annotations

import re

import pytest

from kvserve.tune.budget import (FINAL_MARGIN, FINAL_ROUNDS, REPORT_RESERVE_S, Budget,
                                 BudgetTooSmall, longest_candidate_s, minimum_budget_s,
                                 process_started)
from kvserve.tune.search import SPACE, Trial, Tuner

STEP_S = 0.25  # a real replay stops at the first step that ends past its deadline


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeReplayTuner(Tuner):
    """A tuner whose candidates take ``seconds_of(settings)`` on a fake clock and score
    ``score_of(settings)``; a replay that reaches ``until`` stops at the end of the step
    that crossed it, and the candidate fails, as a real cut replay does."""

    def __init__(self, clock: FakeClock, first_replay_s: float, seconds_of, score_of):
        self.clock, self.first_replay_s = clock, first_replay_s
        self.first_replay_complete = True
        self.seconds_of, self.score_of = seconds_of, score_of
        self.trials, self.seed, self.objective = [], 0, "throughput"
        self.space = {k: list(v) for k, v in SPACE.items()}
        self.space["num_threads"] = [1, 2]
        self.measured: list[dict] = []

    def measure(self, settings: dict, until: float = float("inf")) -> Trial:
        trial, start = Trial(settings), self.clock()
        self.measured.append(settings)
        end = start + self.seconds_of(settings)
        if end > until:
            self.clock.now = max(start, until) + STEP_S
            trial.error = "the budget ran out during this candidate's replay"
        else:
            self.clock.now = end
            trial.throughput = self.score_of(settings)
        trial.seconds = self.clock() - start
        return trial


def by_batch_size(settings: dict) -> float:
    """Replays of 20 s for the defaults; 10 to 60 s for candidates, by max_num_seqs."""
    return {8: 60.0, 16: 40.0, 32: 20.0, 64: 15.0, 128: 12.0, 256: 10.0}.get(
        settings.get("max_num_seqs"), 20.0)


def _run(budget_s: float, startup_s: float, seconds_of=by_batch_size,
         score_of=lambda s: 100.0 + s.get("max_num_seqs", 0)):
    """A whole run on the fake clock: start-up, the search, the final re-measurement,
    and REPORT_RESERVE_S of report; the tuner, the best, the re-measured scores."""
    clock = FakeClock()
    budget = Budget(budget_s, clock=clock, started=0.0)
    clock.now = startup_s  # loading and the first replay
    tuner = FakeReplayTuner(clock, seconds_of({}), seconds_of, score_of)
    best = tuner.search(budget, {})
    again = tuner.remeasure(budget, {}, best)
    clock.now += REPORT_RESERVE_S
    return tuner, budget, best, again


@pytest.mark.parametrize("budget_s, startup_s", [(420, 30), (420, 150), (600, 10),
                                                 (200, 50)])
def test_the_whole_run_ends_within_the_budget(budget_s, startup_s):
    tuner, budget, best, again = _run(budget_s, startup_s)
    assert budget.elapsed() <= budget_s * 1.05, budget.elapsed()
    candidates = len(tuner.trials) - 1
    assert candidates >= 1
    assert len(again["defaults"]) == len(again["best"]) == FINAL_ROUNDS  # all re-measured


def test_the_search_goes_on_while_a_candidate_and_the_end_fit():
    """Replays of 20 s each: candidates start while one more and the end (the final
    re-measurement's reserve and the report) fit, so little of the budget is left."""
    tuner, budget, _, again = _run(420, 30, seconds_of=lambda s: 20.0)
    assert 0.9 * 420 <= budget.elapsed() <= 420
    assert len(tuner.trials) - 1 >= 12


def test_a_best_slower_than_the_defaults_still_fits_its_re_measurement():
    """The slower a candidate's replay, the better it scores: the best is the slowest
    measured, its re-measurement the dearest, and the candidates' cut left room for it."""
    tuner, budget, best, again = _run(420, 30, score_of=by_batch_size)
    assert best.seconds == max(t.seconds for t in tuner.trials if not t.error) > 20
    assert budget.elapsed() <= 420 * 1.05
    assert len(again["best"]) == FINAL_ROUNDS


def test_a_candidate_that_never_ends_is_cut_and_the_end_still_fits():
    def seconds_of(settings):
        return 1e9 if settings.get("kv_manager") == "buddy" else 20.0
    tuner, budget, best, again = _run(420, 30, seconds_of=seconds_of)
    cut = [t for t in tuner.trials if t.error]
    assert cut and all("budget ran out" in t.error for t in cut)
    assert best.settings.get("kv_manager") != "buddy"
    assert budget.elapsed() <= 420 * 1.05
    assert again["defaults"] and again["best"]


def test_a_budget_too_small_for_one_trial_is_refused_naming_the_minimum():
    """Loading took 30 s and a replay takes 20: the defaults, one candidate, the final
    re-measurement and the report need 30 + 2 x 20 + 1.1 x 2 x 40 + 2 s."""
    need = minimum_budget_s(30, 20, REPORT_RESERVE_S, defaults_measured=False)
    assert need == pytest.approx(30 + 2 * 20 + FINAL_MARGIN * FINAL_ROUNDS * 40
                                 + REPORT_RESERVE_S)
    with pytest.raises(BudgetTooSmall) as refused:
        _run(need - 1, 30)
    message = str(refused.value)
    assert f"--budget-s {need - 1:g} is too small for one trial" in message
    assert re.search(r"took 30\.0 s and a candidate takes about 20\.0 s", message)
    assert f"Give --budget-s {int(-(-need // 1))} or more" in message
    tuner, budget, _, again = _run(int(-(-need // 1)), 30)  # the minimum does
    assert len(tuner.trials) >= 2 and budget.elapsed() <= budget.seconds * 1.05


def test_a_budget_too_small_is_refused_before_any_candidate():
    clock = FakeClock()
    budget = Budget(60, clock=clock, started=0.0)
    clock.now = 30
    tuner = FakeReplayTuner(clock, 20.0, by_batch_size, lambda s: 1.0)
    with pytest.raises(BudgetTooSmall, match="at least 160 s"):  # 30 + 2 x 20 + 88 + 2
        tuner.search(budget, {})
    assert tuner.measured == [] and clock.now == 30  # nothing ran


def test_a_first_replay_cut_by_the_budget_is_refused_as_a_lower_bound():
    clock = FakeClock()
    budget = Budget(100, clock=clock, started=0.0)
    clock.now = 100  # loading took 70 s; the first replay was cut at the deadline
    tuner = FakeReplayTuner(clock, 30.0, by_batch_size, lambda s: 1.0)
    tuner.first_replay_complete = False
    need = minimum_budget_s(100, 30, REPORT_RESERVE_S, defaults_measured=False)
    with pytest.raises(BudgetTooSmall, match=(
            r"the last replay was cut by the budget after 30.0 s: a candidate takes "
            rf"longer; .* need more than {int(-(-need // 1))} s in all. Give --budget-s over")):
        tuner.search(budget, {})
    assert tuner.measured == []


def test_defaults_slower_than_the_first_replay_are_refused_once_measured():
    """The first replay said 5 s, but a candidate, the defaults, takes 40: checked again
    after the defaults, before any other candidate."""
    clock = FakeClock()
    budget = Budget(150, clock=clock, started=0.0)
    clock.now = 10
    tuner = FakeReplayTuner(clock, 5.0, lambda s: 40.0, lambda s: 1.0)
    with pytest.raises(BudgetTooSmall, match="and the defaults took 50.0 s"):
        tuner.search(budget, {})
    assert tuner.measured == [{}]


def test_the_longest_candidate_leaves_room_for_the_end_whoever_wins():
    clock = FakeClock()
    budget = Budget(300, clock=clock, started=0.0)
    clock.now = 100  # 200 s left; defaults 20 s, best so far 10 s
    longest = longest_candidate_s(budget, 20, 10, REPORT_RESERVE_S)
    as_best = longest + FINAL_MARGIN * FINAL_ROUNDS * (20 + longest) + REPORT_RESERVE_S
    assert as_best == pytest.approx(200)  # ending then, as the new best, fits exactly
    assert longest_candidate_s(budget, 20, 150, REPORT_RESERVE_S) < 0  # no room at all


@pytest.mark.parametrize("bad", [0, -5, float("inf"), float("nan")])
def test_a_budget_must_be_positive_seconds(bad):
    with pytest.raises(ValueError, match="--budget-s must be a positive number"):
        Budget(bad)


def test_the_budget_counts_from_the_process_start():
    import time
    started = process_started()
    assert 0 <= time.monotonic() - started < 3600


def test_defaults_cut_by_the_budget_are_refused_as_a_lower_bound():
    """The first replay said 5 s, but the defaults' replay is still running at the
    deadline: cut there, and the run refused, naming more than it has."""
    clock = FakeClock()
    budget = Budget(60, clock=clock, started=0.0)
    clock.now = 10
    tuner = FakeReplayTuner(clock, 5.0, lambda s: 1000.0, lambda s: 1.0)
    with pytest.raises(BudgetTooSmall, match=r"need more than \d+ s in all"):
        tuner.search(budget, {})
    assert tuner.measured == [{}] and clock.now <= 60 + STEP_S

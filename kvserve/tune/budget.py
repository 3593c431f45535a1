"""The time budget of ``kvserve tune``: ``--budget-s`` is a promise that the whole run,
loading, the search, the final re-measurement and the report, ends within it.

The budget runs from the start of the command. Loading the model and a first replay of
the workload (to warm its kernels) show what a candidate costs; measuring the defaults
shows it again. The end is reserved from the start: the final re-measurement (the
defaults and the best so far, twice each, at what they took, with a margin) and the
report. A candidate starts only if one as slow as the typical one so far can end before
that reserve, and its replay is cut at the latest time that still leaves room for the
end even if it turns out the best: a cut candidate is discarded. A budget too small for
the defaults, one candidate and the end is refused before the search, with the least
that would do.
"""
from __future__ import annotations

import math
import os
import time
from typing import Callable

REPORT_RESERVE_S = 2.0  # the report: candidate lines, YAML, JSON, the plot
FINAL_MARGIN = 1.1      # a re-measured candidate may take this much longer than it did
FINAL_ROUNDS = 2        # the final re-measurement: the defaults and the best, this many times


class BudgetTooSmall(ValueError):
    """The budget cannot hold the defaults, one candidate and the end."""


class Budget:
    """``seconds`` from ``started`` (now, by default) on ``clock``."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic,
                 started: float | None = None) -> None:
        if not seconds > 0 or math.isinf(seconds):
            raise ValueError(f"--budget-s must be a positive number of seconds, got {seconds}")
        self.seconds, self.clock = float(seconds), clock
        self.started = clock() if started is None else started
        self.deadline = self.started + self.seconds

    def elapsed(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        return self.deadline - self.clock()


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value >= 1 else f"{1000 * value:.0f} ms"


def process_started(clock: Callable[[], float] = time.monotonic) -> float:
    """When this process started, on ``clock`` (Linux: from /proc; elsewhere: now), so
    that the budget also covers the interpreter's start and its imports."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        since = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return clock()
    return clock() - max(0.0, since)


def final_reserve_s(defaults_s: float, best_s: float, report_s: float) -> float:
    """Seconds the end takes: the defaults and the best re-measured FINAL_ROUNDS times
    each (at what each took, with FINAL_MARGIN), and the report."""
    return FINAL_MARGIN * FINAL_ROUNDS * (defaults_s + best_s) + report_s


def longest_candidate_s(budget: Budget, defaults_s: float, best_s: float,
                        report_s: float) -> float:
    """The longest a candidate starting now may take and still leave room for the end,
    whether it turns out the best (the final re-measurement then takes its time) or not.
    Negative: none can."""
    left = budget.left()
    as_new_best = ((left - FINAL_MARGIN * FINAL_ROUNDS * defaults_s - report_s)
                   / (1 + FINAL_MARGIN * FINAL_ROUNDS))
    if as_new_best >= best_s:
        return as_new_best
    return left - final_reserve_s(defaults_s, best_s, report_s)


def minimum_budget_s(startup_s: float, candidate_s: float, report_s: float,
                     defaults_measured: bool) -> float:
    """Seconds a run needs for the defaults, one candidate and the end, given what the
    start took (``startup_s``: loading, the first replay, and the defaults when
    ``defaults_measured``) and what a candidate takes."""
    ahead = candidate_s * (1 if defaults_measured else 2)
    return startup_s + ahead + final_reserve_s(candidate_s, candidate_s, report_s)


def refuse_if_too_small(budget: Budget, startup_s: float, candidate_s: float,
                        report_s: float, defaults_measured: bool,
                        candidate_known: bool = True) -> None:
    """Raise BudgetTooSmall, naming the least budget that would do, when the budget
    cannot hold the defaults, one candidate and the end (``candidate_known`` False: the
    first replay was cut by the budget after ``candidate_s``, so a candidate takes
    longer, and the least budget is more than the one named)."""
    need = minimum_budget_s(startup_s, candidate_s, report_s, defaults_measured)
    if candidate_known and budget.seconds >= need:
        return
    start = ("loading the model, a first replay and the defaults" if defaults_measured
             else "loading the model and a first replay")
    if candidate_known:
        took = (f"{start} took {_seconds(startup_s)} and a candidate takes about "
                f"{_seconds(candidate_s)}")
        least, give = f"at least {math.ceil(need)} s", f"{math.ceil(need)} or more"
    else:
        took = (f"{start} took {_seconds(startup_s)}, and the last replay was cut by the "
                f"budget after {_seconds(candidate_s)}: a candidate takes longer")
        least, give = f"more than {math.ceil(need)} s", f"over {math.ceil(need)}"
    raise BudgetTooSmall(
        f"--budget-s {budget.seconds:g} is too small for one trial: {took}; the defaults, "
        f"one candidate, the final re-measurement ({FINAL_ROUNDS} x the defaults and the "
        f"best) and the report need {least} in all. Give --budget-s {give} (or fewer "
        "--num-prompts, a shorter replay)")

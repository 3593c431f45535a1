"""The alert rules of ``deploy/prometheus/alerts.yml``, evaluated in-process for the
dashboard, so a server without a Prometheus still shows what would be firing.

Same names, thresholds, windows and ``for`` durations as the Prometheus rules (a test
compares them). A rule whose condition holds is ``pending`` until it has held for its
``for`` duration, then ``firing``; conditions are checked whenever a reader asks, so
"held since" means since the first read that saw it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

WINDOW_S = 300.0  # the rules' rate window (5m)


@dataclass(frozen=True)
class AlertRule:
    name: str
    severity: str
    for_s: float
    threshold: float
    # (points, ttft samples, engine alive, now, threshold) -> summary text, or None: quiet
    check: Callable[..., str | None]


def _span(points, now):
    older = [p for p in points if p.t <= now - WINDOW_S]
    return (older[-1] if older else points[0]), points[-1]


def _kv_usage(points, ttft, alive, now, limit):
    usage = points[-1].kv_usage
    return f"KV cache usage is {usage:.0%}" if usage > limit else None


def _failures(points, ttft, alive, now, limit):
    old, new = _span(points, now)
    done = new.finished - old.finished
    failed = new.failed - old.failed
    if done > 0 and failed / done > limit:
        return f"{failed / done:.0%} of the requests of the last 5 minutes failed or aborted"
    return None


def _queue(points, ttft, alive, now, limit):
    old, new = _span(points, now)
    if new.waiting > limit and new.waiting > old.waiting:
        return f"{new.waiting} requests waiting and the queue is growing"
    return None


def _ttft(points, ttft, alive, now, limit):
    values = [v for t, v in ttft if t >= now - WINDOW_S]
    if not values:
        return None
    p99 = float(np.percentile(np.asarray(values), 99))
    return f"P99 time to first token is {p99:.2f}s (SLO {limit:g}s)" if p99 > limit else None


def _engine(points, ttft, alive, now, limit):
    return None if alive else "the engine loop is not running; the server answers 503"


def _preemptions(points, ttft, alive, now, limit):
    old, new = _span(points, now)
    dt = new.t - old.t
    rate = (new.preemptions - old.preemptions) / dt if dt > 0 else 0.0
    return f"{rate:.1f} preemptions per second" if rate > limit else None


RULES = (
    AlertRule("KVCacheUsageHigh", "warning", 300, 0.85, _kv_usage),
    AlertRule("RequestFailureRateHigh", "critical", 120, 0.05, _failures),
    AlertRule("RequestQueueGrowing", "warning", 300, 16, _queue),
    AlertRule("TimeToFirstTokenP99AboveSLO", "warning", 300, 2.0, _ttft),
    AlertRule("EngineDown", "critical", 60, 0, _engine),
    AlertRule("PreemptionStorm", "warning", 300, 1.0, _preemptions),
)


class AlertEvaluator:
    def __init__(self, rules: tuple[AlertRule, ...] = RULES) -> None:
        self.rules = rules
        self._since: dict[str, float] = {}
        self._lock = threading.Lock()

    def evaluate(self, points, ttft, engine_alive: bool, now: float) -> list[dict]:
        """The active alerts: name, severity, state (pending | firing), summary."""
        active = []
        with self._lock:
            for rule in self.rules:
                summary = rule.check(points, ttft, engine_alive, now, rule.threshold)
                if summary is None:
                    self._since.pop(rule.name, None)
                    continue
                since = self._since.setdefault(rule.name, now)
                state = "firing" if now - since >= rule.for_s else "pending"
                active.append({"name": rule.name, "severity": rule.severity, "state": state,
                               "summary": summary})
        return active

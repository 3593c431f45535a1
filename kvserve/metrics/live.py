"""LiveStats: the last minutes of the server, for ``GET /v1/stats`` and the dashboard.

The engine thread writes (cheap: a tuple kept, a sample appended); the event loop reads
and does the arithmetic (rates, percentiles, alerts), so a dashboard watching never
slows a step. Counters are kept cumulative, one point a second for five minutes (the
longest alert window): any rate over any window is a difference of two points, and an
idle engine needs no timer — the current totals stand for "now".
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvserve.metrics.alerts import AlertEvaluator
from kvserve.metrics.prometheus import STEP_PARTS, TRANSFER_KINDS

HISTORY_S = 300        # points kept (one a second)
CHART_POINTS = 60      # points the dashboard draws
RATE_WINDOW_S = 10.0   # tokens/s, preemptions/s, bytes/s
LATENCY_WINDOW_S = 60.0
MAX_SAMPLES = 32768    # latency samples kept (the window's, at most)


@dataclass(frozen=True)
class Totals:
    """The engine's state and cumulative counters at one moment (monotonic ``t``)."""

    t: float
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_utilization: float = 1.0
    kv_fragmentation: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    failed: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    transfer_bytes: tuple = (0,) * len(TRANSFER_KINDS)
    step_seconds: tuple = (0.0,) * len(STEP_PARTS)
    profiled_steps: int = 0


def _rate(new: Totals, old: Totals, field: str) -> float:
    dt = new.t - old.t
    return (getattr(new, field) - getattr(old, field)) / dt if dt > 0 else 0.0


def _percentiles_ms(samples: list[tuple[float, float]], since: float) -> dict:
    values = [v for t, v in samples if t >= since]
    if not values:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(values), [50, 99])
    return {"p50": round(float(p50) * 1e3, 3), "p99": round(float(p99) * 1e3, 3)}


class LiveStats:
    def __init__(self, model_name: str, kv_manager: str = "", num_blocks: int = 0,
                 alerts: AlertEvaluator | None = None, start: float | None = None) -> None:
        self.model_name = model_name
        self.kv_manager, self.num_blocks = kv_manager, num_blocks
        self.alerts = alerts or AlertEvaluator()
        self.started = time.monotonic() if start is None else start
        self._lock = threading.Lock()
        self._current = Totals(self.started)
        self._points: deque[Totals] = deque([self._current], maxlen=HISTORY_S + 1)
        self.ttft: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self.tpot: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self.batch_counts = None  # a callable giving the batch queue's counts, when there is one

    # -- engine thread -------------------------------------------------------------------

    def record(self, totals: Totals) -> None:
        with self._lock:
            self._current = totals
            if totals.t - self._points[-1].t >= 1.0:
                self._points.append(totals)

    # -- readers -------------------------------------------------------------------------

    def _window(self, now: float) -> list[Totals]:
        """The points, then the current totals as of ``now``."""
        with self._lock:
            points, current = list(self._points), self._current
        if current.t > points[-1].t:
            points.append(current)
        last = points[-1]
        if now > last.t:  # nothing changed since: the totals still hold
            points.append(Totals(now, **{k: v for k, v in vars(last).items() if k != "t"}))
        return points

    @staticmethod
    def _at(points: list[Totals], t: float) -> Totals:
        """The latest point at or before ``t`` (the first point if none)."""
        older = [p for p in points if p.t <= t]
        return older[-1] if older else points[0]

    def view(self, engine_alive: bool = True, now: float | None = None) -> dict:
        """The JSON of GET /v1/stats."""
        now = time.monotonic() if now is None else now
        points = self._window(now)
        cur = points[-1]
        recent = self._at(points, now - RATE_WINDOW_S)
        minute = self._at(points, now - LATENCY_WINDOW_S)
        to_unix = time.time() - now
        queries = cur.prefix_queries - minute.prefix_queries
        steps = cur.profiled_steps - minute.profiled_steps
        spent = [a - b for a, b in zip(cur.step_seconds, minute.step_seconds)]
        step_total = sum(spent)
        dt = cur.t - recent.t
        transfer = {k: (a - b) / dt if dt > 0 else 0.0 for k, a, b in
                    zip(TRANSFER_KINDS, cur.transfer_bytes, recent.transfer_bytes)}
        ttft, tpot = list(self.ttft), list(self.tpot)
        state = {
            "object": "kvserve.stats", "time": round(time.time(), 3), "model": self.model_name,
            "uptime_s": round(now - self.started, 1),
            "running": cur.running, "waiting": cur.waiting,
            "tokens_per_s": {"prompt": _rate(cur, recent, "prompt_tokens"),
                             "generation": _rate(cur, recent, "generation_tokens")},
            "ttft_ms": _percentiles_ms(ttft, now - LATENCY_WINDOW_S),
            "tpot_ms": _percentiles_ms(tpot, now - LATENCY_WINDOW_S),
            "kv": {"manager": self.kv_manager, "usage": cur.kv_usage,
                   "utilization": cur.kv_utilization, "fragmentation": cur.kv_fragmentation,
                   "num_blocks": self.num_blocks},
            "prefix_cache": {"hit_rate": (cur.prefix_hits - minute.prefix_hits) / queries
                             if queries else None},
            "preemptions": {"total": cur.preemptions,
                            "per_s": _rate(cur, recent, "preemptions")},
            "kv_transfer": {"bytes_per_s": transfer},
            "step_time": {"step_ms": step_total / steps * 1e3 if steps else None,
                          **{p: s / step_total if step_total else None
                             for p, s in zip(STEP_PARTS, spent)}},
            "requests": {"finished": cur.finished, "failed": cur.failed},
            "batch": self.batch_counts() if self.batch_counts else None,
            "history": self._history(points, to_unix),
        }
        state["alerts"] = self.alerts.evaluate(points, ttft, engine_alive, now)
        return state

    @staticmethod
    def _history(points: list[Totals], to_unix: float) -> list[dict]:
        out = []
        chart = points[-(CHART_POINTS + 1):]
        for old, new in zip(chart, chart[1:]):
            out.append({"t": round(new.t + to_unix, 3), "running": new.running,
                        "waiting": new.waiting, "kv_usage": new.kv_usage,
                        "prompt_tps": _rate(new, old, "prompt_tokens"),
                        "gen_tps": _rate(new, old, "generation_tokens")})
        return out

"""The in-process alerts: pending, then firing after ``for``; the same rules as Prometheus'."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvserve.metrics.alerts import RULES, AlertEvaluator
from kvserve.metrics.live import Totals

ALERTS_YML = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"


def evaluate(evaluator, points, ttft=(), alive=True, now=None):
    now = points[-1].t if now is None else now
    return {a["name"]: a for a in evaluator.evaluate(points, list(ttft), alive, now)}


def test_kv_usage_pending_then_firing_then_quiet():
    ev = AlertEvaluator()
    high = [Totals(float(t), kv_usage=0.9) for t in range(0, 400, 10)]
    assert evaluate(ev, high[:1])["KVCacheUsageHigh"]["state"] == "pending"
    assert evaluate(ev, high[:20])["KVCacheUsageHigh"]["state"] == "pending"   # 190 s
    fired = evaluate(ev, high)["KVCacheUsageHigh"]                            # 390 s
    assert fired["state"] == "firing" and fired["summary"] == "KV cache usage is 90%"
    assert "KVCacheUsageHigh" not in evaluate(ev, [Totals(400.0, kv_usage=0.5)])


@pytest.mark.parametrize("failed, fires", [(0, False), (3, False), (10, True)])
def test_failure_rate(failed, fires):
    points = [Totals(0.0), Totals(300.0, finished=100, failed=failed)]
    assert ("RequestFailureRateHigh" in evaluate(AlertEvaluator(), points)) is fires


def test_no_traffic_is_not_a_failure():
    assert evaluate(AlertEvaluator(), [Totals(0.0), Totals(300.0)]) == {}


def test_queue_ttft_engine_and_preemptions():
    points = [Totals(0.0, waiting=20), Totals(300.0, waiting=40, preemptions=600)]
    active = evaluate(AlertEvaluator(), points, ttft=[(299.0, 3.0)] * 10, alive=False)
    assert set(active) == {"RequestQueueGrowing", "TimeToFirstTokenP99AboveSLO", "EngineDown",
                           "PreemptionStorm"}
    steady = [Totals(0.0, waiting=40), Totals(300.0, waiting=40)]
    assert evaluate(AlertEvaluator(), steady, ttft=[(299.0, 0.5)]) == {}


def _seconds(duration: str) -> float:
    value, unit = re.fullmatch(r"(\d+)([smh])", duration).groups()
    return int(value) * {"s": 1, "m": 60, "h": 3600}[unit]


def test_same_rules_as_the_prometheus_file():
    rules = {r["alert"]: r for g in yaml.safe_load(ALERTS_YML.read_text())["groups"]
             for r in g["rules"]}
    assert set(rules) == {r.name for r in RULES}
    for rule in RULES:
        prom = rules[rule.name]
        assert _seconds(prom["for"]) == rule.for_s, rule.name
        assert prom["labels"]["severity"] == rule.severity, rule.name
        assert re.search(rf"[>=]=? *{rule.threshold:g}\b", prom["expr"]), rule.name

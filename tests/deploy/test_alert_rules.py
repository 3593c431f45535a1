"""The Prometheus alert rules and scrape config in deploy/prometheus, checked by promtool."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.tools import require_tool

PROM_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def _promtool(*args: str) -> None:
    promtool = require_tool("promtool", "prometheus")
    # cwd: alerts_test.yml and prometheus.yml name alerts.yml relative to themselves.
    res = subprocess.run([promtool, *args], cwd=PROM_DIR, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, (f"promtool {' '.join(args)} exited {res.returncode}\n"
                                 f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}")


@pytest.mark.parametrize("args", [("check", "rules", "alerts.yml"),
                                  ("check", "config", "prometheus.yml"),
                                  ("test", "rules", "alerts_test.yml")],
                         ids=["check-rules", "check-config", "test-rules"])
def test_promtool(args):
    _promtool(*args)


def _load(name: str) -> dict:
    return yaml.safe_load((PROM_DIR / name).read_text())


def test_every_alert_is_documented_and_tested():
    rules = [r for g in _load("alerts.yml")["groups"] for r in g["rules"] if "alert" in r]
    for rule in rules:
        assert rule.get("labels", {}).get("severity") in ("warning", "critical"), rule["alert"]
        for key in ("summary", "description", "runbook"):
            assert rule.get("annotations", {}).get(key), f"{rule['alert']}: no {key}"
    names = {r["alert"] for r in rules}
    assert len(names) == len(rules), "duplicate alert names"

    cases = _load("alerts_test.yml")["tests"]
    checks = [c for t in cases for c in t.get("alert_rule_test", [])]
    fires = {c["alertname"] for c in checks if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in checks if not c.get("exp_alerts")}
    # A new rule needs a case where it fires and one where it stays quiet.
    assert fires == names, f"alerts never expected to fire: {names - fires}; " \
                           f"tested but not defined: {fires - names}"
    assert quiet == names, f"alerts never expected to stay quiet: {names - quiet}; " \
                           f"tested but not defined: {quiet - names}"

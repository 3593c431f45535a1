"""The Grafana dashboard in deploy/grafana/kvserve.json, checked against the series that
kvserve really exposes.

Every PromQL query of the dashboard may name only series that a fresh ``ServerMetrics``
renders, and only labels those series carry (plus ``instance`` and ``job``, which
Prometheus adds when it scrapes). ``dashboard_queries`` turns the queries into plain
PromQL, with Grafana's variables filled in, so that a test with a live Prometheus
(tests/deploy/test_prometheus_live.py) can run each of them.
"""
from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvserve.metrics import ServerMetrics
from tests.deploy.tools import require_tool

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvserve.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
NO_QUERY_PANELS = {"row", "alertlist", "text"}
# labels that come from the scrape, not from the exposition
SCRAPE_LABELS = {"instance", "job"}

METRIC_RE = re.compile(r"kvserve:[a-zA-Z0-9_:]+")
# a metric name and the matchers in braces right after it; quoted values may hold braces
SELECTOR_RE = re.compile(r'(kvserve:[a-zA-Z0-9_:]+)\s*(?:\{((?:[^}"]|"(?:[^"\\]|\\.)*")*)\})?')
MATCHER_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
GROUPING_RE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
# Grafana's variable forms: $name, ${name}, ${name:format}, [[name]]
VARIABLE_RE = re.compile(r"\$\{(\w+)(?::[\w-]+)?\}|\$(\w+)|\[\[(\w+)\]\]")
RANGE_VALUE = "1m"


# -- reading the dashboard ------------------------------------------------------------------

def load_dashboard(path: Path | str = DASHBOARD) -> dict:
    return json.loads(Path(path).read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, the ones inside collapsed rows included."""
    out = []

    def walk(panels):
        for panel in panels:
            out.append(panel)
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return out


def raw_queries(dashboard: dict) -> list[tuple[str, str]]:
    """``(panel title, expr)`` for every target that has an expression."""
    return [(p.get("title", ""), t["expr"]) for p in all_panels(dashboard)
            for t in p.get("targets", []) if t.get("expr")]


def substitute(expr: str, model_name: str) -> str:
    """``expr`` with Grafana's variables replaced by values that Prometheus takes as they
    are. A variable without a value here stays, so the caller can see it (a ``$``)."""
    quoted = model_name.replace("\\", "\\\\").replace('"', '\\"')  # a PromQL string literal
    values = {"model_name": quoted, "instance": ".*",
              "__rate_interval": RANGE_VALUE, "__interval": RANGE_VALUE}

    def one(match: re.Match) -> str:
        name = next(g for g in match.groups() if g is not None)
        return values.get(name, match.group(0))

    return VARIABLE_RE.sub(one, expr)


def dashboard_queries(path: Path | str = DASHBOARD, model_name: str = "m") -> list[str]:
    """Every distinct query of the dashboard at ``path`` (in panel order), as PromQL that
    Prometheus runs directly: ``$model_name`` -> ``model_name``, ``$instance`` -> ``.*``,
    ``$__rate_interval`` and ``$__interval`` -> ``1m``."""
    out = []
    for _, expr in raw_queries(load_dashboard(path)):
        query = substitute(expr, model_name)
        if query not in out:
            out.append(query)
    return out


# -- what kvserve exposes ---------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def exposed_series() -> dict[str, frozenset[str]]:
    """Sample name (``_total``, ``_bucket``, ``_sum``, ``_count`` included) -> its labels,
    as a freshly built server renders them."""
    metrics = ServerMetrics("m")
    metrics.publish_cache_config({"kv_manager": "paged", "block_size": 16, "num_kv_blocks": 64,
                                  "cache_dtype": "float32", "enable_prefix_caching": True})
    metrics.accepted_at(0)  # the per-position counter has no child until one is touched
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render()[0].decode()):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(names) for name, names in labels.items()}


def _grouping_labels(expr: str) -> list[tuple[str, str]]:
    """``(clause, label)`` for every label in by/without/on/ignoring/group_left/right."""
    return [(clause, label.strip()) for clause, inside in GROUPING_RE.findall(expr)
            for label in inside.split(",") if label.strip()]


def _selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """``(metric name, [(label, operator, value), ...])`` for every series selector."""
    return [(m.group(1), MATCHER_RE.findall(m.group(2) or ""))
            for m in SELECTOR_RE.finditer(expr)]


def check_expr(expr: str, series: dict[str, frozenset[str]]) -> list[str]:
    """What is wrong with ``expr``: unknown metric names, labels its series lack."""
    problems = []
    names = set(METRIC_RE.findall(expr))
    if not names:
        problems.append("names no kvserve series")
    unknown = sorted(names - series.keys())
    problems += [f"unknown metric {n}" for n in unknown]
    known = names & series.keys()
    have = set().union(*(series[n] for n in known)) | SCRAPE_LABELS | {"le"}
    for clause, label in _grouping_labels(expr):
        if label not in have:
            problems.append(f"{clause} ({label}): no series of the query has that label")
    for name, matchers in _selectors(expr):
        if name not in series:
            continue
        for label, _, _ in matchers:
            if label not in series[name] | SCRAPE_LABELS:
                problems.append(f"{name}{{{label}=...}}: {name} has no label {label}")
    return problems


def check_filters(expr: str, series: dict[str, frozenset[str]]) -> list[str]:
    """Each selector limited to the chosen servers, and to the chosen model wherever the
    series has a model_name (cache_config_info has none: it is joined on instance)."""
    problems = []
    for name, matchers in _selectors(expr):
        present = {(label, op, value) for label, op, value in matchers}
        if ("instance", "=~", "$instance") not in present:
            problems.append(f'{name}: no instance=~"$instance"')
        if "model_name" in series.get(name, ()) and \
                ("model_name", "=", "$model_name") not in present:
            problems.append(f'{name}: no model_name="$model_name"')
    return problems


# -- the tests --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dashboard() -> dict:
    return load_dashboard()


def test_dashboard_settings(dashboard):
    assert dashboard["schemaVersion"] == 39
    assert dashboard["refresh"] == "5s"
    assert dashboard["time"] == {"from": "now-30m", "to": "now"}
    assert dashboard["title"] and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query" and model["datasource"] == DATASOURCE
    assert model["definition"] == "label_values(kvserve:num_requests_running, model_name)"
    for var in (model, variables["instance"]):  # a plain string, or the editor's object
        query = var["query"]
        assert (query if isinstance(query, str) else query["query"]) == var["definition"]
    instance = variables["instance"]
    assert instance["type"] == "query" and instance["datasource"] == DATASOURCE
    assert instance["includeAll"] and instance["allValue"] == ".*"


def test_variable_queries_name_exposed_series(dashboard):
    series = exposed_series()
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["definition"])
        assert match, var["definition"]
        selector, label = match.groups()
        assert check_expr(selector, series) == [], var["name"]
        (name, _), = _selectors(selector)
        assert label in series[name] | SCRAPE_LABELS, (var["name"], label)


def test_panels_have_ids_positions_and_targets(dashboard):
    panels = all_panels(dashboard)
    ids = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids), ids
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    for p in panels:
        where = f"panel {p.get('id')} {p.get('title')!r}"
        assert p.get("title"), f"{where}: no title"
        pos = p.get("gridPos")
        assert pos and all(isinstance(pos.get(k), int) for k in ("h", "w", "x", "y")), where
        assert pos["w"] > 0 and pos["h"] > 0 and 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, \
            f"{where}: gridPos {pos}"
        if p["type"] in NO_QUERY_PANELS:
            continue
        assert p.get("description"), f"{where}: no description"
        assert p.get("datasource") == DATASOURCE, where
        targets = p.get("targets") or []
        assert targets, f"{where}: no targets"
        refs = [t.get("refId") for t in targets]
        assert len(set(refs)) == len(refs), f"{where}: duplicate refIds {refs}"
        for target in targets:
            assert target.get("expr"), f"{where}: a target without expr"
            assert target.get("datasource") == DATASOURCE, where


def test_top_level_panels_do_not_overlap(dashboard):
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard["panels"]:  # inside a collapsed row, Grafana lays panels out anew
        pos = p["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_queries_name_only_exposed_series_and_labels(dashboard):
    series = exposed_series()
    problems = [f"{title!r}: {problem}\n    {expr}" for title, expr in raw_queries(dashboard)
                for problem in check_expr(expr, series)]
    assert not problems, "\n".join(problems)


def test_queries_are_filtered_by_model_and_instance(dashboard):
    series = exposed_series()
    problems = [f"{title!r}: {problem}\n    {expr}" for title, expr in raw_queries(dashboard)
                for problem in check_filters(expr, series)]
    assert not problems, "\n".join(problems)
    for title, expr in raw_queries(dashboard):
        assert 'model_name="$model_name"' in expr, title


def test_memory_design_panels_group_by_kv_manager(dashboard):
    top = dashboard["panels"]
    start = next((i for i, p in enumerate(top)
                  if p["type"] == "row" and p["title"] == "Memory designs compared"), None)
    assert start is not None, "no row 'Memory designs compared'"
    # a row's panels: nested when it is collapsed, else the top-level ones up to the next row
    members = list(top[start].get("panels") or [])
    if not members:
        for p in top[start + 1:]:
            if p["type"] == "row":
                break
            members.append(p)
    assert members, "the row 'Memory designs compared' holds no panels"
    for p in members:
        for target in p["targets"]:
            assert "kvserve:cache_config_info" in target["expr"], p["title"]
            assert "group_left(kv_manager)" in target["expr"].replace(" (", "("), p["title"]
            assert "{{kv_manager}}" in target["legendFormat"], p["title"]


def test_checks_catch_mistakes():
    """The checks above would see a misspelt metric, a missing label and a lost filter."""
    series = exposed_series()
    f = 'model_name="$model_name", instance=~"$instance"'
    assert check_expr(f"rate(kvserve:request_succes_total{{{f}}}[1m])", series)
    assert check_expr(f"sum by (kind) (rate(kvserve:prompt_tokens_total{{{f}}}[1m]))", series)
    assert check_expr('kvserve:cache_config_info{model_name="m"}', series)
    assert check_expr("kvserve:kv_cache_usage_perc * on (instance) group_left(manager) "
                      "kvserve:cache_config_info", series)
    assert check_filters('kvserve:num_requests_running{instance=~"$instance"}', series)
    assert not check_expr(f"histogram_quantile(0.5, sum by (le) "
                          f"(rate(kvserve:time_to_first_token_seconds_bucket{{{f}}}[1m])))",
                          series)


def test_dashboard_queries_leave_no_variables():
    queries = dashboard_queries(DASHBOARD, "my-model")
    assert queries
    assert len(queries) == len(set(queries))
    for query in queries:
        assert "$" not in query and "[[" not in query, query
        assert 'model_name="my-model"' in query, query
    assert substitute('x{model_name="${model_name}"}[$__interval]', 'a"b') == \
        'x{model_name="a\\"b"}[1m]'


def test_queries_parse_with_promtool(tmp_path):
    """promtool parses each query, as the body of a recording rule."""
    promtool = require_tool("promtool", "prometheus")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": q}
        for i, q in enumerate(dashboard_queries(DASHBOARD, "m"))]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    res = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"

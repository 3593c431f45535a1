"""The README is the user's reference: its settings table lists every engine setting, and
the rows naming pluggable designs list exactly what the registries hold."""
from __future__ import annotations

import re
from pathlib import Path

from kvserve import EngineArgs
from kvserve.core.batching import BATCHING_POLICIES
from kvserve.core.kv import KV_MANAGERS

README = Path(__file__).resolve().parents[2] / "README.md"


def _settings_rows() -> dict[str, str]:
    text = README.read_text()
    table = text.split("## Engine settings", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|(.*)$", table, flags=re.M)
    return dict(rows)


def test_every_setting_has_a_row_and_no_row_is_stale():
    assert set(_settings_rows()) == EngineArgs.field_names()


def test_design_rows_name_exactly_the_registered_designs():
    rows = _settings_rows()
    for setting, registry in (("kv_manager", KV_MANAGERS), ("batching", BATCHING_POLICIES)):
        named = re.findall(r"`([a-z-]+)`", rows[setting].split("|")[-2])
        assert named == list(registry.names()), setting


# What a user opens the README for, in this order: what it is, how to run it, how to
# use it, what it supports, how it is built, what it depends on and why, how fast it is.
README_SECTIONS = ["Set-up", "Using it", "Models", "Engine settings", "How it works",
                   "Observability", "Deploy", "Correctness", "The embedded model",
                   "Dependencies", "Performance"]


def test_readme_stays_a_users_document():
    text = README.read_text()
    assert re.findall(r"^## (.+)$", text, flags=re.M) == README_SECTIONS
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    assert "make serve" in setup and "make test" in setup, "the two set-up commands"
    assert "<!--" not in text, "a placeholder was left in the README"
    assert "docs/performance.md" in text
    for name in ("Python", "Command line", "HTTP"):
        assert f"### {name}" in text.split("## Using it", 1)[1].split("\n## ", 1)[0], name


def test_the_model_table_is_the_registry():
    from kvserve.model.registry import model_table
    models = README.read_text().split("## Models", 1)[1].split("\n## ", 1)[0]
    assert model_table() in models

"""docs/architecture.md is the map of the package: its floors picture is the one the
imports draw now (and has no circle), and it names every registry of a pluggable family."""
from __future__ import annotations

import re
from pathlib import Path

from tools.floors import BEGIN, DOC, END, circles, picture, room_graph

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_has_no_import_circles():
    assert circles(room_graph()) == []


def test_the_floors_picture_is_the_current_one():
    drawn = DOC.read_text().split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert drawn == picture(room_graph()), "run `python -m tools.floors --write`"


def test_every_registry_is_in_the_table():
    registries = {}
    for path in (ROOT / "kvserve").rglob("*.py"):
        for name in re.findall(r"^(\w+)\s*(?::[^=\n]*)?=\s*Registry\(", path.read_text(),
                               flags=re.M):
            registries[name] = path.relative_to(ROOT / "kvserve").as_posix()
    assert len(registries) >= 5
    rows = dict(re.findall(r"^\| `(\w+)` \| `([\w/.]+)` \|", DOC.read_text(), flags=re.M))
    assert rows == registries

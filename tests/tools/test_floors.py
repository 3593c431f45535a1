"""tools/floors.py: rooms, circles and floors read from the imports."""
from __future__ import annotations

import pytest

from tools.floors import BEGIN, END, circles, floors, room_graph, with_picture


def _package(tmp_path, files: dict[str, str]):
    root = tmp_path / "kvserve"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_rooms_and_arrows_come_from_imports(tmp_path):
    package = _package(tmp_path, {
        "__init__.py": "from kvserve.engine.llm import LLM\n",
        "engine/__init__.py": "", "engine/llm.py": "from kvserve.core import x\n",
        "core/__init__.py": "from . import kv\n", "core/kv.py": "from ..logger import log\n",
        "logger.py": "import logging\n",
        "worker/__init__.py": "def f():\n    from kvserve.core.kv import y\n",
        "model/__init__.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from kvserve.engine import z\n"),
    })
    graph = room_graph(package)
    assert graph == {"kvserve": {"engine"}, "engine": {"core"}, "core": {"logger"},
                     "logger": set(), "worker": {"core"}, "model": set()}
    assert floors(graph) == {"logger": 0, "model": 0, "core": 1, "worker": 2, "engine": 2,
                             "kvserve": 3}


def test_a_circle_has_no_floor():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    with pytest.raises(ValueError, match=r"circle: \[\['a', 'b', 'c'\]\]"):
        floors(graph)


def test_picture_goes_between_the_markers():
    doc = f"intro\n{BEGIN}\nold\n{END}\nrest\n"
    assert with_picture(doc, "new") == f"intro\n{BEGIN}\nnew\n{END}\nrest\n"
    with pytest.raises(ValueError, match="no <!-- floors:begin -->"):
        with_picture("no markers", "new")

"""kvserve.config is the ground floor: it imports no other room of the package, so every
layer can read its settings and none is dragged in by them."""
from __future__ import annotations

from tools.floors import room_graph


def test_config_imports_no_other_room():
    assert room_graph()["config"] == set()

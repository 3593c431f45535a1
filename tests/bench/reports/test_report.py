"""What a bench writes: JSON without the paths of the machine that ran it."""
from __future__ import annotations

import json

from kvserve.bench.reports.report import without_machine_paths, write_json


def test_machine_paths_are_cut_to_their_last_component(tmp_path):
    given = {"command": "/work/x/.venv/bin/python -m kvserve.cli serve /home/u/models/m1 --port 1",
             "config": ["model='/tmp/kvserve-a1/spec.json', tp=1", "served=/opt/m/llama,"],
             "kept": ["http://127.0.0.1:8000/v1/completions", "/v1/completions", "0.5/1.0"],
             "number": 3}
    expected = {"command": "python -m kvserve.cli serve m1 --port 1",
                "config": ["model='spec.json', tp=1", "served=llama,"],
                "kept": given["kept"], "number": 3}
    assert without_machine_paths(given) == expected
    path = write_json(tmp_path / "r.json", given)
    assert json.loads(path.read_text()) == expected

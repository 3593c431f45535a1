"""The speed measurement's parts: the parameter count read from the checkpoint's
header, and a fresh process's start-up timed apart from its import."""
from __future__ import annotations

from pathlib import Path

from kvserve.default_model import default_model_dir
from tools.default_model.speed import _parameters, fresh_process_start_up


def test_parameters_are_counted_as_transformers_counts_them():
    from transformers import AutoModelForCausalLM

    model_dir = Path(default_model_dir())
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert _parameters(model_dir) == model.num_parameters()


def test_a_fresh_process_reports_its_import_and_its_engine_apart():
    times = fresh_process_start_up(Path(default_model_dir()), runs=1)
    assert set(times) == {"import_s", "llm_ready_s"}
    assert all(0 < t < 120 for t in times.values())

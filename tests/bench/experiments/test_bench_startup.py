"""kvserve bench startup: starts with the saved plan against starts that measure, in
alternating rounds; every planned start runs the saved plan's choices."""
from __future__ import annotations

import pytest

from kvserve.bench.experiments.startup import run_startup_bench


def test_startup_rounds_time_both_ways_and_check_the_plan(llama_dir):
    result = run_startup_bench(llama_dir, {"num_kv_blocks": 64}, rounds=2, log=lambda s: None)
    assert [len(v) for v in result["round_start_s"].values()] == [2, 2]
    assert result["speedup"].rounds == 2
    # the suite's start-up measurements are fixed (tests/conftest.py): every start agrees
    assert result["measured_starts_choosing_the_saved_plan"] == 2
    assert result["plan"]["captured_max_rows"] == 8


def test_startup_refuses_the_settings_it_sets_itself(llama_dir):
    with pytest.raises(ValueError, match="sets --tuning-plan itself"):
        run_startup_bench(llama_dir, {"tuning_plan": "x.json"}, rounds=1)

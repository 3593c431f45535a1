"""kvserve bench startup: starts with the saved plan against starts that measure, in
alternating rounds; every planned start runs the saved plan's choices."""
from __future__ import annotations

import json

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


def test_a_gguf_files_conversion_is_timed_on_its_own(tmp_path, capsys):
    from kvserve.bench.workloads.gguf_models import make_gguf_bench_model
    from kvserve.bench.workloads.models import BenchModelSpec
    from kvserve.cli import main
    from kvserve.default_model import default_model_dir

    path = make_gguf_bench_model(BenchModelSpec(256, 2, 4, 2, 512, vocab_size=8320), "tiny",
                                 "gguf-bf16", tmp_path / "tiny-bf16.gguf", default_model_dir())
    assert main(["bench", "startup", "--model", str(path), "--rounds", "1",
                 "--num-kv-blocks", "64", "--json", str(tmp_path / "s.json")]) == 0
    assert "the GGUF file's conversion: " in capsys.readouterr().out
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["model"] == "tiny-bf16.gguf" and saved["result"]["gguf_conversion_s"] > 0
    assert [len(v) for v in saved["result"]["round_start_s"].values()] == [1, 1]

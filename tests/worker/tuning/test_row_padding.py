"""Small GEMMs padded to a measured row count: the choice rule, the tuning, the setting."""
from __future__ import annotations

import pytest

from kvserve.engine.engine_args import EngineArgs
from kvserve.model.linear_method import packed_linear_available
from kvserve.worker.tuning.row_padding import choose_min_rows, measure_min_rows, packed_linears

# cold passes over bench-100m's linear layers (ms) measured on an AVX-512 CPU
MEASURED = {1: 14.4, 2: 16.2, 3: 13.5, 4: 12.8, 5: 11.8, 6: 11.5, 7: 13.6, 8: 14.2}


def test_choose_the_fastest_count_when_it_beats_the_smaller_ones():
    assert choose_min_rows(MEASURED) == 6


@pytest.mark.parametrize("times", [
    {1: 10.0, 2: 10.5, 3: 11.0, 4: 12.0},     # more rows, more time: no padding
    {1: 10.0, 2: 9.8, 3: 9.7, 4: 12.0},       # faster, but by less than 5 %
    {1: 10.0},
], ids=["monotonic", "small-gain", "one-count"])
def test_no_padding_without_a_clear_gain(times):
    assert choose_min_rows(times) == 1


def test_gain_is_against_the_mean_of_the_padded_counts():
    # 4 rows take 20 % less than 1, but only 13 % less than 1-3 on average
    times = {1: 10.0, 2: 9.0, 3: 8.5, 4: 8.0}
    assert choose_min_rows(times, required_gain=0.05) == 4
    assert choose_min_rows(times, required_gain=0.2) == 1


def test_ties_go_to_fewer_rows():
    assert choose_min_rows({1: 10.0, 2: 8.0, 3: 8.0}) == 2


@pytest.mark.skipif(not packed_linear_available(), reason="torch without oneDNN")
def test_engine_measures_or_takes_the_setting(llama_dir):
    from kvserve import LLM
    measured = LLM(llama_dir).engine.worker
    assert 1 <= measured.linear_min_rows <= 8
    layers = packed_linears(measured.runner.model)
    assert layers and {m.method.min_rows for m in layers} == {measured.linear_min_rows}
    fixed = LLM(llama_dir, linear_min_rows=4).engine.worker
    assert fixed.linear_min_rows == 4
    assert {m.method.min_rows for m in packed_linears(fixed.runner.model)} == {4}
    with pytest.raises(ValueError, match="unpadded"):  # measuring padded layers is wrong
        measure_min_rows(fixed.runner.model, rounds=1)


@pytest.mark.skipif(not packed_linear_available(), reason="torch without oneDNN")
def test_measurement_times_every_row_count_and_changes_no_layer(llama_dir):
    from kvserve import LLM
    model = LLM(llama_dir, linear_min_rows=1).engine.worker.runner.model
    rows, times = measure_min_rows(model, rounds=1)
    assert sorted(times) == list(range(1, 9)) and all(t > 0 for t in times.values())
    assert rows == choose_min_rows(times)
    assert {m.method.min_rows for m in packed_linears(model)} == {1}


@pytest.mark.parametrize("value", [0, -1, 17, 2.5, True])
def test_setting_is_validated(value):
    with pytest.raises(ValueError, match="linear_min_rows"):
        EngineArgs(linear_min_rows=value)


@pytest.mark.skipif(not packed_linear_available(), reason="torch without oneDNN")
def test_measuring_leaves_the_global_generator_alone(llama_dir):
    import torch

    from kvserve import LLM
    model = LLM(llama_dir, linear_min_rows=1).engine.worker.runner.model
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    measure_min_rows(model, rounds=1)
    assert torch.equal(torch.rand(3), expected)

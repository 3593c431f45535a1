"""GEMM kernels warmed at start: which shapes and row counts, within the caches' room."""
from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.engine.engine_args import EngineArgs
from kvserve.model.linear_method import packed_linear_available
from kvserve.worker.tuning.gemm_warmup import (CACHE_HEADROOM, distinct_shapes, kernel_cache_capacity,
                                        rows_to_warm, warm_gemm_kernels)
from kvserve.worker.tuning import tuner

needs_onednn = pytest.mark.skipif(not packed_linear_available(), reason="torch without oneDNN")


def test_capacity_is_the_smaller_cache_and_defaults_to_1024():
    assert kernel_cache_capacity({}) == 1024
    assert kernel_cache_capacity({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "600"}) == 600
    assert kernel_cache_capacity({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "600",
                                  "LRU_CACHE_CAPACITY": "400"}) == 400
    assert kernel_cache_capacity({"LRU_CACHE_CAPACITY": "many"}) == 1024


def test_rows_fit_the_caches_next_to_the_headroom():
    assert rows_to_warm(128, 5, 1024) == 128
    assert rows_to_warm(256, 5, 1024) == (1024 - CACHE_HEADROOM) // 5
    assert rows_to_warm(8, 0, 1024) == 0
    assert rows_to_warm(8, 5, CACHE_HEADROOM) == 0


@needs_onednn
def test_every_distinct_shape_runs_at_every_row_count(llama_dir):
    llm = LLM(llama_dir, gemm_warmup_rows=0)
    model = llm.engine.worker.runner.model
    shapes = distinct_shapes(model)
    # qkv, o, gate|up, down, lm_head: the layers repeat these
    assert len(shapes) == 5
    seen = {id(linear): [] for linear in shapes}
    for linear in shapes:
        linear.method.panel_max_rows = 0  # all on oneDNN, whatever the start measured
        forward = linear.forward

        def spy(x, forward=forward, rows=seen[id(linear)]):
            rows.append(x.shape[0])
            return forward(x)
        linear.forward = spy
    assert warm_gemm_kernels(model, 12) == (5, 12)
    assert all(rows == list(range(1, 13)) for rows in seen.values())
    for linear in shapes:  # counts on the native panel GEMM have no kernel to generate
        linear.method.panel_max_rows = 10
    for rows in seen.values():
        rows.clear()
    warm_gemm_kernels(model, 12)
    assert all(rows == [1, 2, 3, 4, 5, 6, 7, 8, 11, 12] for rows in seen.values())


@needs_onednn
@pytest.mark.parametrize("setting, expected", [(None, 16), (5, 5), (0, None)])
def test_engine_warms_up_to_max_num_seqs_unless_told(llama_dir, monkeypatch, setting,
                                                     expected):
    calls = []
    original = tuner.warm_gemm_kernels

    def record(model, max_rows):
        calls.append(max_rows)
        return original(model, max_rows)
    monkeypatch.setattr(tuner, "warm_gemm_kernels", record)
    LLM(llama_dir, max_num_seqs=16, gemm_warmup_rows=setting)
    assert calls == ([] if expected is None else [expected])


@pytest.mark.parametrize("bad", [-1, 2.5, "8"])
def test_bad_setting_is_named(bad):
    with pytest.raises(ValueError, match="gemm_warmup_rows must be an integer >= 0"):
        EngineArgs(gemm_warmup_rows=bad)

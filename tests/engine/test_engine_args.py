"""EngineArgs: each setting a config part holds takes the part's default, and reaches
the part by its name."""
from __future__ import annotations

import dataclasses

import pytest

from kvserve.config import CacheConfig, SchedulerConfig, WorkerConfig
from kvserve.config.parallel import ParallelConfig
from kvserve.engine.engine_args import EngineArgs

PARTS = (CacheConfig, SchedulerConfig, WorkerConfig, ParallelConfig)
DERIVED = {"swap_enabled", "gemm_warmup_rows"}  # decided by another setting


@pytest.mark.parametrize("part", PARTS, ids=lambda p: p.__name__)
def test_a_part_default_is_the_settings_default(part):
    args = {f.name: f for f in dataclasses.fields(EngineArgs)}
    for f in dataclasses.fields(part):
        if f.name not in DERIVED:
            assert args[f.name].default == f.default, f.name


def test_each_setting_reaches_its_part():
    args = EngineArgs(block_size=8, max_num_seqs=7, num_threads=3, tensor_parallel_size=2,
                      preemption_mode="swap")
    assert args.create_cache_config().block_size == 8
    assert args.create_cache_config().swap_enabled
    assert args.create_scheduler_config().max_num_seqs == 7
    assert args.create_worker_config().num_threads == 3
    assert args.create_worker_config().gemm_warmup_rows == 7  # default: max_num_seqs
    assert args.create_parallel_config().tensor_parallel_size == 2

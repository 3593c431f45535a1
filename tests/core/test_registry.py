"""Pluggable families: a fourth KV manager is one file and one registration line, and
every place that names the designs (validation, CLI, bench memory) picks it up."""
from __future__ import annotations

import argparse

import pytest

from kvserve import LLM, EngineArgs, SamplingParams
from kvserve.bench.experiments.memory import combos
from kvserve.core.batching import BATCHING_POLICIES
from kvserve.core.kv import KV_MANAGERS
from kvserve.registry import Registry
from tests.core.stack_kv_manager import StackKVCacheManager
from tests.helpers import hf_greedy, prompts_of_lengths


@pytest.fixture
def stack_registered():
    KV_MANAGERS.register("stack", StackKVCacheManager)  # the one registration line
    yield
    KV_MANAGERS.unregister("stack")


def test_unknown_names_are_refused_with_the_registered_ones():
    with pytest.raises(ValueError, match=r"kv_manager must be one of \['paged', 'buddy', "
                                         r"'contiguous'\], got 'stack'"):
        EngineArgs(kv_manager="stack")
    with pytest.raises(ValueError, match=r"batching must be one of \['continuous', "
                                         r"'length-bucket', 'static'\]"):
        EngineArgs(batching="fifo")


def test_a_name_cannot_be_taken_twice():
    reg: Registry[type] = Registry("thing")
    reg.register("a", int)
    reg.register("a", int)  # the same member again: harmless
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register("a", str)
    assert reg.names() == ("a",) and reg["a"] is int


def test_a_registered_manager_reaches_validation_cli_and_bench(stack_registered):
    EngineArgs(kv_manager="stack")
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--kv-manager", "stack"]).kv_manager == "stack"
    assert ("stack", "static") in combos()
    assert len(combos()) == len(KV_MANAGERS.names()) * len(BATCHING_POLICIES.names())


def test_a_fourth_manager_gives_transformers_tokens(stack_registered, llama_dir):
    prompts = prompts_of_lengths([1, 7, 17, 40, 64, 100, 5, 31])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # a budget below the workload's: requests are preempted and re-placed
    llm = LLM(llama_dir, kv_manager="stack", num_kv_blocks=24, block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert isinstance(llm.engine.kv, StackKVCacheManager)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 12)
    assert llm.engine.scheduler.num_preemptions > 0, "no preemption: the test lost its point"
    assert llm.engine.kv.stats().num_used_blocks == 0

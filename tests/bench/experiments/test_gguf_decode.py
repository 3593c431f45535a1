"""``bench gguf-decode``: kvserve and llama.cpp's llama-bench on the same GGUF file (slow:
llama-bench is built from the vendored source), rounds paired, the floor from the file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.bench.cli import main
from kvserve.bench.experiments.gguf_decode import context_prompt, kvserve_decode_rate, \
    kvserve_prompt_rate
from kvserve.bench.workloads.gguf_models import make_gguf_bench_model
from kvserve.bench.workloads.models import BenchModelSpec
from kvserve.default_model import default_model_dir
from tests.format_tools import llama_cpp_source, llama_cpp_tool


def test_only_the_decode_steps_after_a_deep_context_are_timed(llama_dir):
    """A prompt longer than a step's chunk takes several steps before its first token;
    the rate counts the steps after it, and a second round finds the context cached."""
    from kvserve import LLM

    llm = LLM(llama_dir, block_size=4, max_num_batched_tokens=32)
    engine, steps = llm.engine, []
    step = engine.step
    engine.step = lambda: steps.append(1) or step()
    prompt = context_prompt(1, 100, engine.vocab_size)
    assert len(prompt) == 101
    assert kvserve_decode_rate(llm, 8, prompt) > 0
    assert len(steps) == 4 + 8  # chunks of 32, 32, 32 and 5 tokens, then 8 decode steps
    steps.clear()
    assert kvserve_decode_rate(llm, 8, prompt, reset_prefix_cache=False) > 0
    assert len(steps) == 1 + 8  # the context from the prefix cache: one step to the token
    assert not engine.has_unfinished_requests()


def test_a_timed_prompt_is_computed_whole_every_time(llama_dir):
    """The prefix cache is emptied first: each call computes all of the prompt's chunks."""
    from kvserve import LLM

    llm = LLM(llama_dir, block_size=4, max_num_batched_tokens=32)
    engine, steps = llm.engine, []
    step = engine.step
    engine.step = lambda: steps.append(1) or step()
    prompt = context_prompt(1, 79, engine.vocab_size)
    for _ in range(2):
        steps.clear()
        assert kvserve_prompt_rate(llm, prompt) > 0
        assert len(steps) == 3  # chunks of 32, 32 and 16 tokens; the last gives the token
    assert not engine.has_unfinished_requests()


# big enough that each system runs long enough for its threads to be seen on every core
SEEN_ON_BOTH_CORES = BenchModelSpec(1024, 4, 8, 4, 2816)


def _gguf_decode(tmp_path, spec: BenchModelSpec, *options: str) -> dict:
    """``bench gguf-decode`` on a Q8_0 file of ``spec`` made by llama-quantize, against
    llama-bench built from the same source; its JSON's result."""
    tree = llama_cpp_source(Path.home() / ".cache" / "kvserve-tests" / "llama-cpp")
    gguf = make_gguf_bench_model(spec, "tiny", "gguf-q8_0", tmp_path / "tiny-q8_0.gguf",
                                 default_model_dir(), llama_cpp_tool(tree, "llama-quantize"))
    out = tmp_path / "decode.json"
    assert main(["bench", "gguf-decode", str(gguf), "--llama-bench",
                 str(llama_cpp_tool(tree, "llama-bench")), *options, "--num-kv-blocks", "32",
                 "--json", str(out)]) == 0
    return json.loads(out.read_text())["result"]


@pytest.mark.slow
def test_both_systems_decode_the_same_file_on_the_same_cores(tmp_path):
    res = _gguf_decode(tmp_path, SEEN_ON_BOTH_CORES, "--rounds", "2",
                       "--tokens", "128", "--prompt-tokens", "64")
    row = res["files"]["tiny-q8_0.gguf"]
    assert len(row["kvserve_tok_s"]) == len(row["llamacpp_tok_s"]) == 2
    assert all(rate > 0 for rate in row["kvserve_tok_s"] + row["llamacpp_tok_s"])
    assert row["ratio"]["rounds"] == 2
    assert set(row["bytes_by_format"]) == {"Q8_0", "F32"}
    assert 0 < row["stream_floor_ms"] < row["kvserve_step_ms"]
    assert len(row["round_bandwidth_gbs"]) == 2  # each round's floor from its own read
    assert row["vs_stream_floor"]["kvserve"]["rounds"] == 2
    assert row["kvserve_vs_stream_floor"] == row["vs_stream_floor"]["kvserve"]["median"]
    cpus = res["cpus"]["tiny-q8_0.gguf"]
    assert cpus["kvserve"]["ran_on"] and cpus["llama-bench"]["allowed"] == \
        cpus["kvserve"]["allowed"]
    assert res["llamacpp_build"]["build_commit"]
    pp = row["prompt"]  # one prompt of 64 tokens a round, timed by both
    assert pp["tokens"] == res["prompt_tokens"] == 64 and pp["ratio"]["rounds"] == 2
    assert all(rate > 0 for rate in pp["kvserve_tok_s"] + pp["llamacpp_tok_s"])


@pytest.mark.slow
def test_a_context_depth_is_given_to_both_systems(tmp_path):
    res = _gguf_decode(tmp_path, SEEN_ON_BOTH_CORES, "--rounds", "1", "--tokens", "128",
                       "--depth", "64")
    assert res["depth"] == 64
    assert res["files"]["tiny-q8_0.gguf"]["llamacpp_tok_s"][0] > 0

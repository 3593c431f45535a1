"""``bench gguf-decode``: kvserve and llama.cpp's llama-bench on the same GGUF file (slow:
llama-bench is built from the vendored source), rounds paired, the floor from the file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.bench.cli import main
from kvserve.bench.workloads.gguf_models import make_gguf_bench_model
from kvserve.bench.workloads.models import BenchModelSpec
from kvserve.default_model import default_model_dir
from tests.format_tools import llama_cpp_source, llama_cpp_tool


@pytest.mark.slow
def test_both_systems_decode_the_same_file_on_the_same_cores(tmp_path):
    tree = llama_cpp_source(Path.home() / ".cache" / "kvserve-tests" / "llama-cpp")
    # big enough that each system runs long enough for its threads to be seen
    spec = BenchModelSpec(1024, 4, 8, 4, 2816)
    gguf = make_gguf_bench_model(spec, "tiny", "gguf-q8_0", tmp_path / "tiny-q8_0.gguf",
                                 default_model_dir(), llama_cpp_tool(tree, "llama-quantize"))
    out = tmp_path / "decode.json"
    assert main(["bench", "gguf-decode", str(gguf), "--llama-bench",
                 str(llama_cpp_tool(tree, "llama-bench")), "--rounds", "2", "--tokens", "128",
                 "--num-kv-blocks", "32", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["result"]
    row = res["files"]["tiny-q8_0.gguf"]
    assert len(row["kvserve_tok_s"]) == len(row["llamacpp_tok_s"]) == 2
    assert all(rate > 0 for rate in row["kvserve_tok_s"] + row["llamacpp_tok_s"])
    assert row["ratio"]["rounds"] == 2
    assert set(row["bytes_by_format"]) == {"Q8_0", "F32"}
    assert 0 < row["stream_floor_ms"] < row["kvserve_step_ms"]
    cpus = res["cpus"]["tiny-q8_0.gguf"]
    assert cpus["kvserve"]["ran_on"] and cpus["llama-bench"]["allowed"] == \
        cpus["kvserve"]["allowed"]
    assert res["llamacpp_build"]["build_commit"]

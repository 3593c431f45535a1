"""``kvserve bench serving`` with a stand-in for vLLM's server (a kvserve server behind
vLLM's module path and flags): both servers measured every round, the idle one paused,
the ratios derived from the rounds."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvserve.bench.experiments.serving import paired_ratios, run_serving_bench
from kvserve.bench.workloads.definitions import BenchRequest
from kvserve.bench.workloads.gguf_models import make_gguf_bench_model
from kvserve.bench.workloads.models import BenchModelSpec
from kvserve.default_model import default_model_dir
from tests.bench.conftest import record_served
from tests.format_tools import llama_cpp_source, llama_cpp_tool

# vllm.entrypoints.openai.api_server: vLLM's flags, a kvserve server underneath
FAKE_API_SERVER = '''
import argparse, os, sys
p = argparse.ArgumentParser()
for flag in ("--model", "--host", "--port", "--served-model-name", "--dtype", "--seed",
             "--uvicorn-log-level"):
    p.add_argument(flag)
a = p.parse_args()
assert a.dtype == "float32" and a.host == "127.0.0.1"
assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
os.execv(sys.executable, [sys.executable, "-m", "kvserve.cli", "serve", a.model,
         "--host", a.host, "--port", a.port, "--served-model-name", a.served_model_name,
         "--max-num-seqs", "2", "--state-dir", os.environ["FAKE_VLLM_STATE"]])
'''



@pytest.mark.slow  # (15-25 s: `make test` stays near 10 minutes)
def test_both_servers_every_round(tmp_path: Path, tiny_model_dir: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.bench.experiments import serving

    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_API_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_VLLM_STATE", str(tmp_path / "vllm-state"))
    started: dict[str, object] = {}
    for name, cls in (("kvserve", serving.ServerProcess), ("vllm", serving.VllmServer)):
        def make(*args, _cls=cls, _name=name, **kwargs):
            started[_name] = server = _cls(*args, **kwargs)
            return server
        monkeypatch.setattr(serving, cls.__name__, make)
    served = record_served(monkeypatch, started)

    warmup = [BenchRequest([3, 4, 5], 2)] * 2
    rounds = [[BenchRequest([3 + i + 10 * r, 4, 5, 6], 8) for i in range(4)] for r in range(2)]
    lines: list[str] = []
    result = run_serving_bench(tiny_model_dir, warmup, rounds, {"max_num_seqs": 4},
                               sys.executable, float("inf"), kv_cache_gib=1, log=lines.append)
    # warm-up on each, then round 0 kvserve first, round 1 vLLM first
    assert served == [("kvserve", 2), ("vllm", 2), ("kvserve", 4), ("vllm", 4), ("vllm", 4),
                      ("kvserve", 4)]
    assert sum("round" in line for line in lines) == 2
    assert result["peer"] == "vllm"
    for name in ("kvserve", "vllm"):
        assert len(result["rounds"][name]) == 2
        for r in result["rounds"][name]:
            assert r["completed"] == 4 and r["failed"] == 0 and r["tpot_p99_ms"] > 0
            assert r["output_tokens"] == 4 * 8
        assert started[name].proc.poll() is not None  # both stopped, none left paused
    tpot = result["kvserve_over_peer"]["tpot_p99_ms"]
    by_round = [a["tpot_p99_ms"] / b["tpot_p99_ms"] for a, b in zip(
        result["rounds"]["kvserve"], result["rounds"]["vllm"])]
    assert tpot.per_round == pytest.approx(by_round) and tpot.rounds == 2
    assert (tpot.min, tpot.max) == (pytest.approx(min(by_round)), pytest.approx(max(by_round)))


def _round(failed: int = 0, ttft: float = 100.0, itl: float = 10.0) -> dict:
    return {"failed": failed, "ttft_median_ms": ttft, "ttft_p99_ms": 2 * ttft,
            "tpot_median_ms": 10.0, "tpot_p99_ms": 20.0, "itl_p99_ms": itl}


def test_ratios_are_paired_by_round_and_a_failed_round_is_dropped_from_both() -> None:
    runs = {"kvserve": [_round(ttft=50.0), _round(ttft=90.0), _round(ttft=10.0, itl=0.0)],
            "vllm": [_round(ttft=100.0), _round(failed=1, ttft=1.0), _round(ttft=20.0)]}
    ratios = paired_ratios(runs, "kvserve", "vllm")
    assert set(ratios) == {"ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms",
                           "itl_p99_ms"}
    assert ratios["ttft_median_ms"].per_round == (0.5, 0.5)  # round 2 failed on vLLM's side
    assert ratios["tpot_p99_ms"].to_dict() == {"median": 1.0, "min": 1.0, "max": 1.0,
                                               "rounds": 2, "per_round": [1.0, 1.0]}
    assert ratios["itl_p99_ms"].per_round == (1.0,)  # no ITL in kvserve's round 3
    runs["vllm"][0]["failed"] = 2
    assert paired_ratios(runs, "kvserve", "vllm")["itl_p99_ms"] is None


def test_tensor_parallel_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="without tensor parallelism"):
        run_serving_bench(tiny_model_dir, [], [[]], {"tensor_parallel_size": 2},
                          sys.executable, 1.0)


@pytest.mark.slow
def test_llama_server_is_measured_on_the_same_gguf_file(tmp_path: Path) -> None:
    tree = llama_cpp_source(Path.home() / ".cache" / "kvserve-tests" / "llama-cpp")
    binary = llama_cpp_tool(tree, "llama-server")
    gguf = make_gguf_bench_model(BenchModelSpec(256, 2, 4, 2, 512, vocab_size=8320), "tiny",
                                 "gguf-bf16", tmp_path / "tiny-bf16.gguf", default_model_dir())
    warmup = [BenchRequest([3, 4, 5], 2)] * 2
    rounds = [[BenchRequest([3 + i + 10 * r, 4, 5, 6], 8) for i in range(3)] for r in range(2)]
    result = run_serving_bench(gguf, warmup, rounds, {"num_kv_blocks": 64}, str(binary), 4.0,
                               kv_cache_gib=0.01, log=lambda line: None, peer="llama-server")
    # 0.01 GiB of float16 K and V: 2 layers x 2 KV heads x 64 values x 2 x 2 bytes a token
    assert result["peers"]["llama-server"]["kv_tokens"] == int(0.01 * 2**30) // 1024 // 8 * 8
    for name in ("kvserve", "llama-server"):
        for r in result["rounds"][name]:
            # every request streamed its 8 tokens: llama-server honours ignore_eos too
            assert r["completed"] == 3 and r["failed"] == 0 and r["output_tokens"] == 24
    assert result["kvserve_over_peer"]["tpot_median_ms"].rounds == 2


def test_llama_server_is_given_a_gguf_file(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="llama-server serves a GGUF file"):
        run_serving_bench(tiny_model_dir, [], [[BenchRequest([3], 1)]], {}, "llama-server",
                          1.0, peer="llama-server")


def test_the_command_serves_a_gguf_file_against_llama_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from kvserve.bench.experiments import serving
    from kvserve.cli import main

    gguf = make_gguf_bench_model(BenchModelSpec(256, 2, 4, 2, 512, vocab_size=8320), "tiny",
                                 "gguf-bf16", tmp_path / "tiny-bf16.gguf", default_model_dir())
    calls = []

    def fake(model, warmup, rounds, engine_args, binary, rate, kv_gib, peer, timeout_s):
        calls.append((model, len(warmup), [len(r) for r in rounds], binary, kv_gib, peer,
                      timeout_s))
        run = {"failed": 0, "ttft_median_ms": 1.0, "ttft_p99_ms": 2.0, "tpot_median_ms": 3.0,
               "tpot_p99_ms": 4.0, "itl_p99_ms": 5.0, "output_tok_s": 6.0}
        return {"rounds": {"kvserve": [run] * 2, peer: [run] * 2},
                "kvserve_over_peer": paired_ratios({"kvserve": [run] * 2, peer: [run] * 2},
                                                   "kvserve", peer)}
    monkeypatch.setattr(serving, "run_serving_bench", lambda *a, **kw: fake(*a, **kw))
    assert main(["bench", "serving", "--model", str(gguf), "--peer", "llama-server",
                 "--llama-server", "/bin/llama-server", "--workload", "mixed",
                 "--num-prompts", "3", "--rounds", "2", "--warmup-requests", "1",
                 "--peer-kv-cache-gib", "2", "--request-timeout", "900"]) == 0
    assert calls == [(gguf, 1, [3, 3], "/bin/llama-server", 2.0, "llama-server", 900.0)]
    printed = capsys.readouterr().out
    assert "llama-server" in printed and "kvserve / llama-server" in printed
    with pytest.raises(SystemExit, match="--llama-server PATH"):
        main(["bench", "serving", "--model", str(gguf), "--peer", "llama-server"])

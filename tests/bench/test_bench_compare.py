"""`kvserve bench compare`: the table rows, --against and --variant parsing, and the
runs' order (kvserve, its variants and vLLM in the same rounds), with stub engines."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvserve.bench.compare import compare_rows, parse_against, parse_variant, run_compare
from kvserve.bench.roofline import RooflineResult
from kvserve.bench.throughput import ThroughputResult, count_output_tokens
from kvserve.bench.workloads import BenchRequest


def test_compare_rows_and_against() -> None:
    kv = ThroughputResult(2.0, 4, 100, 40, 40)
    hf = ThroughputResult(8.0, 4, 100, 40, 60)
    rows = compare_rows([("kvserve", kv), ("hf", hf)], "hf", flops=1e10, peak_gflops=100)
    assert rows[0]["vs_hf_static"] == pytest.approx(4.0) and rows[1]["vs_hf_static"] == 1.0
    assert rows[0]["useful_tok_s"] == 20 and rows[0]["total_tok_s"] == 70
    assert rows[0]["roofline_share"] == pytest.approx(0.05)
    assert compare_rows([("kvserve", kv)], None, 1.0, 0.0)[0]["roofline_share"] is None
    assert rows[0]["vs_vllm"] is None
    vl = ThroughputResult(4.0, 4, 100, 40, 40)
    rows = compare_rows([("kvserve", kv), ("kvserve int8", kv), ("vllm-cpu", vl)], None,
                        flops=1e10, peak_gflops=100, quantized=["kvserve int8"])
    assert [r["vs_vllm"] for r in rows] == [pytest.approx(2.0), pytest.approx(2.0), 1.0]
    assert rows[0]["roofline_share"] == pytest.approx(0.05)
    assert rows[1]["roofline_share"] is None  # int8 GEMMs: the float32 roofline does not apply
    assert parse_against("hf, vllm-cpu") == ["hf", "vllm-cpu"]
    with pytest.raises(ValueError):
        parse_against("hf,llama")


def test_parse_variant() -> None:
    assert parse_variant("int8:quantization=int8, kv-cache-dtype=float16") == (
        "int8", {"quantization": "int8", "kv_cache_dtype": "float16"})
    assert parse_variant("big:max_num_seqs=256") == ("big", {"max_num_seqs": 256})
    for bad in ("int8", ":quantization=int8", "x:", "x:quantization", "x:=3"):
        with pytest.raises(ValueError, match="LABEL:KEY=VALUE"):
            parse_variant(bad)


class _FakeLLM:
    """Stands in for kvserve.LLM: returns max_tokens zeros per prompt."""

    resets = 0

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    def generate(self, prompts: list[dict], params: list[Any], use_tqdm: bool = False) -> list[Any]:
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * (p.max_tokens + 1))])
                for p in params]


def test_run_compare_with_stub_engine(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.bench import throughput

    loaded = []
    monkeypatch.setattr(throughput, "load_llm",
                        lambda model_dir, engine_args: (loaded.append(engine_args), (_FakeLLM(), 0.1))[1])
    monkeypatch.setattr(throughput, "_sampling_params", lambda n: SimpleNamespace(max_tokens=n))
    from kvserve.bench import compare
    from kvserve.bench.decode import DecodeResult
    monkeypatch.setattr(compare, "measure_decode", lambda llm, ids: DecodeResult(5, 0.02, 3e8))
    reqs = [BenchRequest([3, 4, 5], 2), BenchRequest([6, 7], 3)]
    roof = RooflineResult(2, {"x": 50.0}, 30.0, 15.0)
    out = run_compare(tiny_model_dir, reqs, ["hf", "vllm-cpu"], {"block_size": 8},
                      hf_batch_size=2, hf_sweep=[1, 2], hf_threads=None, roofline=roof,
                      log=lambda s: None, variants=[("int8", {"quantization": "int8"})])
    names = [r["name"] for r in out["rows"]]
    assert names[:3] == ["kvserve", "kvserve int8", "hf-static-2"]
    assert names[3].startswith("hf-best-")
    assert loaded == [{"block_size": 8}, {"block_size": 8, "quantization": "int8"}]
    assert out["results"]["kvserve int8"]["engine_args"] == loaded[1]
    assert out["results"]["kvserve int8"]["decode"]["vs_gemv_floor"] == pytest.approx(1.0)
    assert out["rows"][0]["roofline_share"] is not None
    assert out["rows"][1]["roofline_share"] is None
    base_int8 = run_compare(tiny_model_dir, reqs, [], {"quantization": "int8"}, roofline=roof,
                            log=lambda s: None)
    assert base_int8["rows"][0]["name"] == "kvserve"
    assert base_int8["rows"][0]["roofline_share"] is None  # int8 however it was asked for
    bf16 = run_compare(tiny_model_dir, reqs, [], {}, roofline=roof, log=lambda s: None,
                       variants=[("bf16", {"dtype": "bfloat16"})])
    assert [r["roofline_share"] is None for r in bf16["rows"]] == [False, True]  # bf16 GEMMs
    assert out["results"]["kvserve"]["useful_output_tokens"] == 5  # capped at max_tokens
    assert out["results"]["kvserve"]["generated_tokens"] == 7
    assert out["rows"][2]["vs_hf_static"] == 1.0
    assert out["notes"] == ["vllm-cpu skipped: no --vllm-python given"]
    assert out["gemm_bound_s"] > 0 and out["roofline"]["peak_gflops"] == 50.0
    assert out["decode"]["gemv_floor_s"] == pytest.approx(0.02)  # 3e8 B at 15 GB/s
    assert out["decode"]["vs_gemv_floor"] == pytest.approx(1.0)
    assert out["decode"]["vs_stream_floor"] == pytest.approx(2.0)
    assert count_output_tokens(reqs, _FakeLLM().generate([], [SimpleNamespace(max_tokens=2)] * 2)) == (2 + 3, 6)
    # ceilings measured again after the runs: each the higher of the two measurements
    slow_then_fast = run_compare(
        tiny_model_dir, reqs, [], {}, roofline=RooflineResult(2, {"x": 40.0}, 30.0, 10.0),
        remeasure_roofline=lambda: RooflineResult(2, {"x": 50.0, "y": 20.0}, 25.0, 15.0),
        log=lambda s: None, variants=[("bf16", {"dtype": "bfloat16"})])
    assert slow_then_fast["roofline"]["gemm_gflops"] == {"x": 50.0, "y": 20.0}
    assert slow_then_fast["roofline"]["sum_bandwidth_gbs"] == 30.0
    row = slow_then_fast["rows"][0]
    assert row["roofline_share"] == pytest.approx(
        slow_then_fast["workload_flops"] / row["wall_s"] / 50e9)
    assert slow_then_fast["results"]["kvserve bf16"]["decode"]["gemv_floor_s"] == pytest.approx(0.02)


class _FakeVllmSession:
    """Stands in for VllmSession: logs each run to ``events``; fails at run ``fail_at``."""

    def __init__(self, events: list[str], fail_at: int | None = None) -> None:
        self.events, self.fail_at, self.closed = events, fail_at, False

    def run(self):
        from kvserve.bench.throughput import ThroughputResult

        self.events.append("vllm")
        if self.events.count("vllm") == self.fail_at:
            raise RuntimeError("vLLM runner failed (exit 1):\nboom")
        return ThroughputResult(10.0, 2, 5, 5, 5)

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("fail_at", [None, 2])
def test_variants_and_vllm_alternate_with_kvserve_defaults(
        tiny_model_dir: Path, fail_at: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine drifts over minutes: kvserve's defaults, the variants and vLLM are
    loaded together and run in the same rounds, before HF; a variant that changes the
    whole process (its thread count) runs alone after them. The table order stays. A
    vLLM failure mid-rounds ends vLLM's runs with a note, and kvserve's go on."""
    from kvserve.bench import compare, throughput, vllm_runner
    from kvserve.bench.decode import DecodeResult

    events: list[str] = []

    class LoggingLLM(_FakeLLM):
        def __init__(self, settings):
            self.name = "/".join(f"{k}={v}" for k, v in settings.items()) or "kvserve"
            self.rate = 2.0 if "quantization" in settings else 1.0

        def generate(self, prompts, params, use_tqdm=False):
            if len(prompts) > 1:  # not the one-prompt warm-up
                events.append(self.name)
            return super().generate(prompts, params, use_tqdm)

    def load(model_dir, engine_args):
        events.append(f"load {engine_args}")
        return LoggingLLM(engine_args), 0.1

    session = _FakeVllmSession(events, fail_at)
    monkeypatch.setattr(throughput, "load_llm", load)
    monkeypatch.setattr(throughput, "_sampling_params", lambda n: SimpleNamespace(max_tokens=n))
    monkeypatch.setattr(compare, "measure_decode", lambda llm, ids: DecodeResult(5, 0.02, 3e8))
    monkeypatch.setattr(vllm_runner, "vllm_importable", lambda python: True)
    monkeypatch.setattr(vllm_runner, "VllmSession", lambda *a, **k: session)
    real_generate_timed = throughput.generate_timed

    def generate_timed(llm, requests, progress=False):  # int8 runs twice as fast
        _, outputs = real_generate_timed(llm, requests, progress)
        return 10.0 / llm.rate, outputs

    monkeypatch.setattr(throughput, "generate_timed", generate_timed)
    lines: list[str] = []
    reqs = [BenchRequest([3, 4, 5], 2), BenchRequest([6, 7], 3)]
    out = run_compare(tiny_model_dir, reqs, ["hf", "vllm-cpu"], {}, hf_batch_size=2,
                      hf_threads=None, vllm_python="python", log=lines.append, repeats=3,
                      variants=[("int8", {"quantization": "int8"}),
                                ("one", {"num_threads": 1})])
    stages = [line for line in lines if not line.startswith("  ")]
    assert [line.split(" (")[0].split(" {")[0] for line in stages] == [
        "starting vLLM CPU in a subprocess ...", "running kvserve, kvserve int8",
        "running kvserve one", "running HF static batching"]
    progress = [line.split(":")[0].strip() for line in lines if line.startswith("  ")]
    assert progress == [f"round {i} of 3" for i in (1, 2, 3)] * 2 + ["HF run"] * 3
    with_peer = [line for line in lines if "vllm-cpu" in line and line.endswith("x)")]
    assert len(with_peer) == (3 if fail_at is None else 1)  # rounds the peer completed
    assert session.closed
    loads = ["load {}", "load {'quantization': 'int8'}"]
    after = ["load {'num_threads': 1}"] + ["num_threads=1"] * 3
    int8 = out["results"]["kvserve int8"]
    assert int8["round_ratios_vs_kvserve"] == [2.0] * 3 and not int8["alone"]
    assert out["results"]["kvserve one"]["alone"]
    assert "round_ratios_vs_kvserve" not in out["results"]["kvserve one"]
    if fail_at is None:
        assert events == loads + ["kvserve", "quantization=int8", "vllm"] * 3 + after
        assert [r["name"] for r in out["rows"]] == ["kvserve", "kvserve int8", "kvserve one",
                                                    "hf-static-2", "vllm-cpu"]
        vllm = out["results"]["vllm-cpu"]
        assert out["rows"][-1]["vs_vllm"] == 1.0 and vllm["repeat_useful_tok_s"] == [0.5] * 3
        kv_rates = out["results"]["kvserve"]["repeat_useful_tok_s"]
        assert vllm["round_ratios"] == [r / 0.5 for r in kv_rates]
    else:
        assert events == loads + ["kvserve", "quantization=int8", "vllm"] * 2 + [
            "kvserve", "quantization=int8"] + after
        assert "vllm-cpu" not in [r["name"] for r in out["rows"]]
        assert any("vllm-cpu failed" in n and "boom" in n for n in out["notes"])
        assert len(out["results"]["kvserve"]["repeat_useful_tok_s"]) == 3


def test_compare_command_measures_the_ceilings_twice_and_keeps_the_higher(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from kvserve.bench import roofline
    from kvserve.entrypoints.cli import main

    rates = iter([40.0, 50.0])  # a slow minute first
    monkeypatch.setattr(roofline, "measure_roofline", lambda threads, repeats: RooflineResult(
        2, {"x": next(rates)}, 30.0, 15.0))
    rc = main(["bench", "compare", "--model", str(tiny_model_dir), "--against", "",
               "--workload", "random", "--num-prompts", "2", "--input-len", "8",
               "--output-len", "3", "--variant", "few:max_num_seqs=1",
               "--json", str(tmp_path / "c.json")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "peak GEMM 50.0 GFLOP/s" in printed
    assert re.search(r"kvserve few / kvserve by round: \d+\.\d{3} \(median", printed)
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["roofline"]["peak_gflops"] == 50.0
    assert data["gemm_bound_s"] == pytest.approx(data["workload_flops"] / 50e9)

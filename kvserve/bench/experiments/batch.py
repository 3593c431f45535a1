"""``kvserve bench batch``: the Batch API beside realtime traffic, in one run.

A ``kvserve serve`` process on loopback (a fresh state directory) and three
measurements, each against a baseline measured in the same run:

- interference: a steady realtime load (Poisson arrivals at ``--request-rate``) alone,
  then the same load while a large batch runs, in alternating rounds; P99 TTFT and
  P99 TPOT of the realtime requests with the batch over without (the median of the
  rounds' ratios, kvserve.bench.instruments.paired), and how many batch lines finished meanwhile
  (the batch is cancelled after each round);
- batch alone: a batch's output tokens/s from creation to completion, over
  ``LLM.generate`` on the same requests in this process (the server idle meanwhile);
- ``run-batch``: the offline command's output tokens/s over ``LLM.generate``.

The first pass over a set of prompt lengths is slower than later ones (oneDNN generates
a GEMM kernel for each new row count), so like is compared with like: the batch's
second run with ``LLM.generate``'s second, and ``run-batch`` (a fresh process, as a user
runs it) with ``LLM.generate``'s first.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kvserve.bench.instruments.paired import describe_ratio, paired_ratio, ratio_cell
from kvserve.bench.peers.server_process import ServerProcess, server_flags
from kvserve.bench.workloads.definitions import BenchRequest

POLL_S = 0.25


class Server(ServerProcess):
    """A server with the Batch API's calls."""

    def create_batch(self, requests: Sequence[BenchRequest]) -> str:
        lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST",
                             "url": "/v1/completions", "body": _body(r)})
                 for i, r in enumerate(requests)]
        upload = self.http.post("/v1/files", data={"purpose": "batch"},
                                files={"file": ("in.jsonl", "\n".join(lines).encode())})
        upload.raise_for_status()
        made = self.http.post("/v1/batches", json={
            "input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"})
        made.raise_for_status()
        return made.json()["id"]

    def batch(self, batch_id: str) -> dict:
        return self.http.get(f"/v1/batches/{batch_id}").json()

    def wait(self, batch_id: str, statuses: tuple[str, ...]) -> dict:
        while (b := self.batch(batch_id))["status"] not in statuses:
            time.sleep(POLL_S)
        return b



def _body(req: BenchRequest) -> dict:
    return {"model": "bench", "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True}


def _realtime(server: Server, requests: Sequence[BenchRequest], rate: float, seed: int) -> dict:
    from kvserve.bench.instruments.serve import run_serve

    result = run_serve(requests, base_url=server.url, model="bench", request_rate=rate,
                       seed=seed)
    lat = result.metrics.latency_ms
    return {"p99_ttft_ms": lat["ttft"]["p99"], "p99_tpot_ms": lat["tpot"]["p99"],
            "p50_ttft_ms": lat["ttft"]["median"], "p50_tpot_ms": lat["tpot"]["median"],
            "completed": result.metrics.completed, "failed": result.metrics.failed}


def interference(server: Server, realtime: Sequence[BenchRequest],
                 batch: Sequence[BenchRequest], rate: float, rounds: int,
                 log: Callable[[str], None]) -> dict:
    runs: dict[str, list[dict]] = {"alone": [], "with_batch": []}
    _realtime(server, realtime, rate, seed=0)  # warm: a first pass pays for new shapes
    for i in range(rounds):
        for name in ("alone", "with_batch") if i % 2 == 0 else ("with_batch", "alone"):
            if name == "alone":
                runs[name].append(_realtime(server, realtime, rate, seed=i))
                continue
            bid = server.create_batch(batch)
            while server.batch(bid)["request_counts"]["completed"] < 1:  # lines running
                time.sleep(POLL_S)
            before = server.batch(bid)["request_counts"]["completed"]
            run = _realtime(server, realtime, rate, seed=i)
            run["batch_lines_done"] = server.batch(bid)["request_counts"]["completed"] - before
            server.http.post(f"/v1/batches/{bid}/cancel")
            server.wait(bid, ("cancelled", "completed"))
            runs[name].append(run)
        a, w = runs["alone"][-1], runs["with_batch"][-1]
        log(f"  round {i + 1} of {rounds}: P99 TTFT {a['p99_ttft_ms']:.1f} -> "
            f"{w['p99_ttft_ms']:.1f} ms, P99 TPOT {a['p99_tpot_ms']:.2f} -> "
            f"{w['p99_tpot_ms']:.2f} ms, batch lines done meanwhile {w['batch_lines_done']}")

    def by_round(name: str, key: str) -> list[float | None]:  # None: a request failed
        return [None if r["failed"] else r[key] for r in runs[name]]
    return {
        "rounds": runs,
        "p99_ttft_ratio": paired_ratio(by_round("with_batch", "p99_ttft_ms"),
                                       by_round("alone", "p99_ttft_ms")),
        "p99_tpot_ratio": paired_ratio(by_round("with_batch", "p99_tpot_ms"),
                                       by_round("alone", "p99_tpot_ms")),
        "batch_lines_done_per_round": statistics.median(
            r["batch_lines_done"] for r in runs["with_batch"]),
    }


def generate_passes(model_dir: Path, requests: Sequence[BenchRequest], engine_args: dict,
                    passes: int) -> list[float]:
    """LLM.generate's output tokens/s on each of ``passes`` passes over ``requests``."""
    from kvserve import LLM, SamplingParams

    llm = LLM(str(model_dir), **engine_args)
    llm.engine.settle()
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in requests]
    rates = []
    for _ in range(passes):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(r.max_tokens for r in requests) / (time.perf_counter() - start))
    llm.engine.close()
    return rates


def _generate_fresh(model_dir: Path, requests: Sequence[BenchRequest], engine_args: dict,
                    workdir: Path) -> float:
    """LLM.generate's first pass in a fresh process, as run-batch's (the load excluded)."""
    spec = workdir / "generate.json"
    spec.write_text(json.dumps({"model": str(model_dir), "engine_args": engine_args,
                                "requests": [[list(r.prompt_token_ids), r.max_tokens]
                                             for r in requests]}))
    done = subprocess.run([sys.executable, "-m", "kvserve.bench.experiments.batch", str(spec)],
                          capture_output=True, text=True, env={**os.environ,
                                                               "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"generate failed:\n{done.stderr}")
    return float(done.stdout.strip().splitlines()[-1])


def batch_alone(server: Server, requests: Sequence[BenchRequest]) -> float:
    """Output tokens/s of the batch's second run (the first warms the server)."""
    for _ in range(2):
        start = time.perf_counter()
        bid = server.create_batch(requests)
        done = server.wait(bid, ("completed", "failed", "cancelled", "expired"))
        seconds = time.perf_counter() - start
        if done["request_counts"]["completed"] != len(requests):
            raise RuntimeError(f"batch {bid} ended {done['status']}: {done['request_counts']}")
    return sum(r.max_tokens for r in requests) / seconds


def run_batch_tok_s(model_dir: Path, requests: Sequence[BenchRequest], engine_flags: list[str],
                    workdir: Path) -> float:
    """``kvserve run-batch`` as a user runs it; its own summary gives the run's seconds
    (the model load excluded, as for LLM.generate)."""
    src, dst = workdir / "run-batch-in.jsonl", workdir / "run-batch-out.jsonl"
    src.write_text("\n".join(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                                         "url": "/v1/completions", "body": _body(r)})
                             for i, r in enumerate(requests)))
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "run-batch", "-i", str(src), "-o",
         str(dst), str(model_dir), "--served-model-name", "bench", "--summary-json",
         str(workdir / "run-batch.json"), *engine_flags],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"run-batch failed:\n{done.stdout}\n{done.stderr}")
    summary = json.loads((workdir / "run-batch.json").read_text())
    return sum(r.max_tokens for r in requests) / summary["seconds"]


def run_batch_bench(model_dir: Path, realtime: Sequence[BenchRequest],
                    batch: Sequence[BenchRequest], alone: Sequence[BenchRequest],
                    engine_args: dict[str, Any], rate: float, rounds: int,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    flags = server_flags(engine_args)
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-batch-") as tmp:
        work = Path(tmp)
        server = Server(model_dir, work / "state", flags, work / "server.log")
        try:
            log(f"interference: {len(realtime)} realtime requests at {rate:g}/s, a "
                f"{len(batch)}-line batch")
            inter = interference(server, realtime, batch, rate, rounds, log)
            log(f"batch alone: {len(alone)} lines")
            served = batch_alone(server, alone)
        finally:
            server.close()
        offline, cold = [], []
        for _ in range(2):  # alternating, each a fresh process
            offline.append(run_batch_tok_s(model_dir, alone, flags, work))
            cold.append(_generate_fresh(model_dir, alone, engine_args, work))
        warm = generate_passes(model_dir, alone, engine_args, 2)[1]
    log(f"  batch {served:.1f} tok/s vs LLM.generate {warm:.1f} (second passes); run-batch "
        f"{statistics.median(offline):.1f} tok/s vs LLM.generate {statistics.median(cold):.1f} "
        "(first passes, medians)")
    return {"interference": inter, "batch_tok_s": served,
            "run_batch_tok_s": statistics.median(offline),
            "generate_first_pass_tok_s": statistics.median(cold),
            "generate_second_pass_tok_s": warm,
            # one pair: the server's batch and LLM.generate cannot share rounds here
            "batch_vs_generate": paired_ratio([served], [warm]),
            "run_batch_vs_generate": paired_ratio(offline, cold)}


def cmd_batch(args) -> int:
    """``kvserve bench batch``."""
    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir
    from kvserve.bench.bench_setup import _header
    from kvserve.bench.reports import report
    from kvserve.bench.workloads.definitions import mixed_workload
    from kvserve.bench.workloads.models import model_vocab

    model_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    vocab, special = model_vocab(model_dir)
    realtime = mixed_workload(vocab, special, args.realtime_requests, seed=1,
                              output_range=(16, 128)).requests
    batch = mixed_workload(vocab, special, args.batch_lines, seed=2).requests
    alone = mixed_workload(vocab, special, args.alone_lines, seed=3).requests
    settings = {"model": model_dir.name, "realtime_requests": len(realtime),
                "request_rate": args.request_rate, "batch_lines": len(batch),
                "alone_lines": len(alone), "rounds": args.rounds, "engine_args": engine_args}
    info = _header("kvserve batch", settings)
    result = run_batch_bench(model_dir, realtime, batch, alone, engine_args,
                             args.request_rate, args.rounds)
    inter = result["interference"]
    print(report.format_table(
        ["P99 TTFT with/without", "P99 TPOT with/without", "batch lines done per round",
         "batch / generate", "run-batch / generate"],
        [(ratio_cell(inter["p99_ttft_ratio"]), ratio_cell(inter["p99_tpot_ratio"]),
          inter["batch_lines_done_per_round"], ratio_cell(result["batch_vs_generate"]),
          ratio_cell(result["run_batch_vs_generate"]))]))
    for label, ratio in (("P99 TTFT with the batch / without", inter["p99_ttft_ratio"]),
                         ("P99 TPOT with the batch / without", inter["p99_tpot_ratio"]),
                         ("batch / LLM.generate", result["batch_vs_generate"]),
                         ("run-batch / LLM.generate", result["run_batch_vs_generate"])):
        print(f"{label}: {describe_ratio(ratio)}")
    if args.json:
        out = {"machine": info, "settings": settings, "result": result}
        print(f"wrote {report.write_json(args.json, out)}")
    return 0


if __name__ == "__main__":  # one LLM.generate pass in a fresh process: prints its tok/s
    spec = json.loads(Path(sys.argv[1]).read_text())
    reqs = [BenchRequest(p, m) for p, m in spec["requests"]]
    print(generate_passes(Path(spec["model"]), reqs, spec["engine_args"], 1)[0])

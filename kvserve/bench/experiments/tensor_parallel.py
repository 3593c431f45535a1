"""``kvserve bench tp``: tensor parallelism against one process, in alternating rounds.

Each round runs each setting in a fresh process of its own (torch's thread count and the
compute threads' binding are per process, so two engines in one would share them): the
workload offline, then single-stream decode. With tensor parallelism, each rank gets its
share of the CPUs, and rank 0 reports what the collectives cost: the all-reduces and the
logits' all-gather, and broadcasting the step's inputs, per decode step. Tensor
parallelism against one process is the median of the rounds' ratios
(kvserve.bench.instruments.paired).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

from kvserve.bench.bench_args import engine_args_from, resolve_model_dir, workload_from_args
from kvserve.bench.bench_setup import _header, _wl_settings, write_result_json
from kvserve.bench.instruments.paired import describe_ratio, paired_ratio
from kvserve.bench.reports import report
from kvserve.bench.workloads.definitions import BenchRequest

DECODE_PROMPT_TOKENS = 128
DECODE_TOKENS = 64


def measure(model_dir: str, requests: list[BenchRequest], engine_args: dict[str, Any]
            ) -> dict[str, Any]:
    """One setting in this process: the workload's throughput, then single-stream decode
    (and, with tensor parallelism, the collectives' share of a decode step)."""
    import time

    from kvserve.bench.instruments.decode import measure_decode
    from kvserve.bench.instruments.throughput import load_llm, run_throughput

    llm, load_s = load_llm(model_dir, engine_args)
    result = run_throughput(model_dir, requests, engine_args, llm=llm)
    worker = llm.engine.worker
    tp = getattr(worker, "tp", None)
    before = (tp.seconds, tp.calls, worker.channel.seconds) if tp is not None else None
    start = time.perf_counter()
    decode = measure_decode(llm, list(requests[0].prompt_token_ids[:DECODE_PROMPT_TOKENS]),
                            DECODE_TOKENS)
    decode_wall = time.perf_counter() - start
    out = {"load_s": load_s, "useful_tok_s": result.useful_tok_s,
           "decode_step_ms": 1000 * decode.median_step_s}
    if tp is not None:
        # every step of the decode run counts (prefills included), so divide by all steps
        steps = decode.steps + 3  # measure_decode's three prefill steps are untimed
        out["collective_ms_per_step"] = 1000 * (tp.seconds - before[0]) / steps
        out["collectives_per_step"] = (tp.calls - before[1]) / steps
        out["broadcast_ms_per_step"] = 1000 * (worker.channel.seconds - before[2]) / steps
        out["decode_wall_s"] = decode_wall
    llm.engine.close()
    return out


def _run_setting(model_dir: str, requests: list[BenchRequest], engine_args: dict[str, Any]
                 ) -> dict[str, Any]:
    job = json.dumps({"model": model_dir, "engine_args": engine_args,
                      "requests": [[r.prompt_token_ids, r.max_tokens] for r in requests]})
    done = subprocess.run([sys.executable, "-m", __name__], input=job, text=True,
                          capture_output=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tp_over_tp1(runs: dict[str, list[dict[str, Any]]], tp_name: str) -> dict[str, Any]:
    """Each setting's median of every figure, and ``tp_name``'s throughput and decode step
    over tp1's, paired by round."""
    def by_round(name: str, key: str) -> list[float]:
        return [r[key] for r in runs[name]]
    return {"median": {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
                       for name, rs in runs.items()},
            "throughput_ratio": paired_ratio(by_round(tp_name, "useful_tok_s"),
                                             by_round("tp1", "useful_tok_s")),
            "decode_step_ratio": paired_ratio(by_round(tp_name, "decode_step_ms"),
                                              by_round("tp1", "decode_step_ms")),
            "rounds": runs}


def cmd_tp(args: argparse.Namespace) -> int:
    model_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    size = engine_args.pop("tensor_parallel_size", None) or 2
    wl = workload_from_args(args, model_dir)
    info = _header("kvserve tp", {"model": model_dir.name, **_wl_settings(wl),
                                  "tensor_parallel_size": size, "engine_args": engine_args,
                                  "rounds": args.rounds})
    settings = {"tp1": dict(engine_args), f"tp{size}": {**engine_args,
                                                        "tensor_parallel_size": size}}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    for i in range(args.rounds):
        order = list(settings) if i % 2 == 0 else list(reversed(settings))
        for name in order:
            runs[name].append(_run_setting(str(model_dir), wl.requests, settings[name]))
        a, b = runs["tp1"][-1], runs[f"tp{size}"][-1]
        print(f"  round {i + 1} of {args.rounds}: tp1 {a['useful_tok_s']:.1f} tok/s, "
              f"{a['decode_step_ms']:.2f} ms/step; tp{size} {b['useful_tok_s']:.1f} tok/s, "
              f"{b['decode_step_ms']:.2f} ms/step (collectives {b['collective_ms_per_step']:.2f} "
              f"ms, broadcast {b['broadcast_ms_per_step']:.2f} ms)", flush=True)
    result = tp_over_tp1(runs, f"tp{size}")
    med = result["median"]
    print(report.format_table(
        ["setting", "useful tok/s", "decode ms/step", "collectives ms/step",
         "broadcast ms/step"],
        [(name, m["useful_tok_s"], m["decode_step_ms"], m.get("collective_ms_per_step", 0.0),
          m.get("broadcast_ms_per_step", 0.0)) for name, m in med.items()]))
    print(f"tp{size} / tp1, throughput: {describe_ratio(result['throughput_ratio'])}")
    print(f"tp{size} / tp1, decode step: {describe_ratio(result['decode_step_ratio'])}")
    if args.json:
        write_result_json(args.json, info, model_dir, wl, engine_args, result,
                          tensor_parallel_size=size)
    return 0


if __name__ == "__main__":  # one setting, as cmd_tp runs it: a JSON job on stdin
    job = json.loads(sys.stdin.read())
    reqs = [BenchRequest(list(p), n) for p, n in job["requests"]]
    print(json.dumps(measure(job["model"], reqs, job["engine_args"])))

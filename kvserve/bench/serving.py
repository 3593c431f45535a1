"""``kvserve bench serving``: kvserve's server against vLLM's OpenAI server, same load.

Both servers are started once, on loopback, with the same model in float32; vLLM's comes
from its own venv (``--vllm-python``). Each first serves a few warm-up requests. Rounds
then alternate between them: in round r both serve that round's own requests (fresh
prompts, so no round hits a prefix another cached), streamed at the same Poisson
arrivals by the ``bench serve`` client. The server not being measured is paused
(SIGSTOP: kvserve's process, vLLM's process group) so that it takes no CPU from the one
that is. Reported per server: TTFT, TPOT and ITL (median and P99) of each round, and
kvserve's over vLLM's by round.
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kvserve.bench.server_process import SERVED_NAME, ServerProcess, free_port, server_flags, \
    wait_healthy
from kvserve.bench.vllm_runner import _env
from kvserve.bench.workloads import BenchRequest

SERVERS = ("kvserve", "vllm")
WARMUP_REQUESTS = 8


class VllmServer:
    """vLLM's OpenAI server from ``python``'s venv, healthy once constructed, in its own
    process group (vLLM runs its engine in a child process)."""

    def __init__(self, python: str, model_dir: Path, log_path: Path, kv_cache_gib: float,
                 omp_bind: str, start_timeout_s: float = 900.0) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
             "--served-model-name", SERVED_NAME, "--dtype", "float32", "--seed", "0",
             "--uvicorn-log-level", "warning"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env=_env(kv_cache_gib, omp_bind))
        # in its own session a Ctrl-C would not reach it: closed on any failure to start
        wait_healthy(self, "vLLM's server", log_path, start_timeout_s, 1.0)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:  # already gone: nothing to pause, resume or stop
            pass

    def close(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


def _summary(result) -> dict[str, Any]:
    m = result.metrics
    return {"completed": m.completed, "failed": m.failed, "duration_s": m.duration_s,
            "output_tok_s": m.output_throughput,
            **{f"{k}_{stat}_ms": s[stat] for k, s in m.latency_ms.items()
               for stat in ("median", "p99")}}


def serve_alternating(servers: dict[str, Any], pause: dict[str, Callable[[int], None]],
                      warmup: Sequence[BenchRequest], rounds: Sequence[Sequence[BenchRequest]],
                      request_rate: float, log_round: Callable[[int, dict], None]
                      ) -> dict[str, list[dict]]:
    """Warm each server up, then serve each round's requests on each server in turn,
    the others paused (``pause[name](signal)``), the order alternating by round; returns
    each server's summaries by round. Raises if a request failed."""
    from kvserve.bench.serve import run_serve

    names = list(servers)

    def resume_only(name: str) -> None:
        for other in names:
            pause[other](signal.SIGCONT if other == name else signal.SIGSTOP)
        time.sleep(1.0)  # the resumed server's threads settle

    for name in names if warmup else ():
        resume_only(name)
        run_serve(warmup, base_url=servers[name].url, model=SERVED_NAME,
                  request_rate=float("inf"))
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r, requests in enumerate(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            resume_only(name)
            res = run_serve(requests, base_url=servers[name].url, model=SERVED_NAME,
                            request_rate=request_rate, seed=r)
            runs[name].append(_summary(res))
            if res.metrics.failed:
                raise RuntimeError(f"{name}: {res.metrics.failed} requests failed: "
                                   + "; ".join(sorted({x.error for x in res.records
                                                       if x.error})[:3]))
        log_round(r, runs)
    return runs


def ratios_by_round(runs: dict[str, list[dict]], a: str, b: str) -> dict[str, list[float]]:
    """``a``'s latencies over ``b``'s, round by round (a latency ``b``'s round did not
    have, such as ITL without a second token, gives no ratio)."""
    return {key: [x[key] / y[key] for x, y in zip(runs[a], runs[b]) if y[key]]
            for key in ("ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms",
                        "itl_p99_ms")}


def run_serving_bench(model_dir: Path, warmup: Sequence[BenchRequest],
                      rounds: Sequence[Sequence[BenchRequest]], engine_args: dict[str, Any],
                      vllm_python: str, request_rate: float, kv_cache_gib: float = 4.0,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """``rounds``: each round's requests (both servers serve the same ones)."""
    if int(engine_args.get("tensor_parallel_size") or 1) > 1:
        raise ValueError("kvserve bench serving pauses one server process: run it without "
                         "tensor parallelism")

    def log_round(r: int, runs: dict[str, list[dict]]) -> None:
        log(f"  round {r + 1} of {len(rounds)}: P99 TPOT kvserve "
            f"{runs['kvserve'][-1]['tpot_p99_ms']:.1f} ms, vLLM "
            f"{runs['vllm'][-1]['tpot_p99_ms']:.1f}; P99 TTFT "
            f"{runs['kvserve'][-1]['ttft_p99_ms']:.0f} vs "
            f"{runs['vllm'][-1]['ttft_p99_ms']:.0f} ms")

    with tempfile.TemporaryDirectory(prefix="kvserve-serving-") as tmp:
        tmp_dir = Path(tmp)
        log("starting kvserve's server ...")
        kvserve = ServerProcess(model_dir, tmp_dir / "state", server_flags(engine_args),
                                tmp_dir / "kvserve.log")
        pause = {"kvserve": lambda sig: kvserve.proc.send_signal(sig)}
        servers = {"kvserve": kvserve}
        try:
            pause["kvserve"](signal.SIGSTOP)
            log("starting vLLM's server ...")
            vllm = servers["vllm"] = VllmServer(vllm_python, model_dir, tmp_dir / "vllm.log",
                                                kv_cache_gib, "0-1")
            pause["vllm"] = vllm.signal
            runs = serve_alternating(servers, pause, warmup, rounds, request_rate, log_round)
        finally:
            for name, server in servers.items():
                pause[name](signal.SIGCONT)
                server.close()
    ratios = ratios_by_round(runs, "kvserve", "vllm")
    return {"request_rate": request_rate, "requests_per_round": len(rounds[0]),
            "warmup_requests": len(warmup), "rounds": runs,
            "kvserve_over_vllm_by_round": ratios,
            "kvserve_over_vllm": {k: statistics.median(v) for k, v in ratios.items() if v}}


def cmd_serving(args) -> int:
    """``kvserve bench serving``."""
    from kvserve.bench import report
    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir, workload_from_args
    from kvserve.bench.bench_setup import _header, _wl_settings, write_result_json

    if not args.vllm_python:
        raise SystemExit("kvserve bench serving needs --vllm-python VENV/bin/python")
    model_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    per_round = args.num_prompts
    args.num_prompts = WARMUP_REQUESTS + per_round * args.rounds  # fresh prompts a round
    wl = workload_from_args(args, model_dir)
    reqs = wl.requests
    rounds = [reqs[WARMUP_REQUESTS + r * per_round:WARMUP_REQUESTS + (r + 1) * per_round]
              for r in range(args.rounds)]
    info = _header("kvserve serving", {"model": model_dir.name, **_wl_settings(wl),
                                       "request_rate": args.request_rate,
                                       "engine_args": engine_args, "rounds": args.rounds})
    try:
        result = run_serving_bench(model_dir, reqs[:WARMUP_REQUESTS], rounds, engine_args,
                                   args.vllm_python, args.request_rate, args.vllm_kv_cache_gib)
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"kvserve: error: {exc}") from None
    rows = []
    for name in SERVERS:
        rounds = result["rounds"][name]
        rows.append((name, *(statistics.median(r[k] for r in rounds) for k in (
            "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms", "output_tok_s"))))
    print(report.format_table(["server", "TTFT median", "TTFT P99", "TPOT median",
                               "TPOT P99", "output tok/s"], rows))
    print("kvserve / vLLM, median of rounds: " + ", ".join(
        f"{k} {v:.3f}x" for k, v in result["kvserve_over_vllm"].items()))
    if args.json:
        write_result_json(args.json, info, model_dir, wl, engine_args, result)
    return 0

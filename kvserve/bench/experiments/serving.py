"""``kvserve bench serving``: kvserve's server against a peer's OpenAI server, same load.

The peer is vLLM's server (``--peer vllm``: the same model directory in float32, from
its own venv, ``--vllm-python``) or llama.cpp's ``llama-server`` (``--peer
llama-server``: the same GGUF file, ``--llama-server PATH``). Both servers are started
once, on loopback, with KV caches of the same bytes. Each first serves a few warm-up
requests. Rounds then alternate between them: in round r both serve that round's own
requests (fresh prompts, so no round hits a prefix another cached), streamed at the
same Poisson arrivals by the ``bench serve`` client. The server not being measured is
paused (SIGSTOP: kvserve's process, the peer's process group) so that it takes no CPU
from the one that is. Reported per server: TTFT, TPOT and ITL (median and P99) of each
round, and kvserve's over the peer's as the median of the rounds' ratios
(kvserve.bench.instruments.paired); a round in which either server failed a request is
left out of the ratios.
"""
from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kvserve.bench.instruments.cpu_sets import CpuSampler, check_same_cpus
from kvserve.bench.instruments.paired import PairedRatio, describe_ratio, paired_ratio
from kvserve.bench.peers.llama_server import LlamaServer
from kvserve.bench.peers.server_process import SERVED_NAME, PeerProcess, ServerProcess, \
    free_port, server_flags, wait_healthy
from kvserve.bench.peers.vllm_runner import _env, vllm_version
from kvserve.bench.workloads.definitions import BenchRequest

PEERS = ("vllm", "llama-server")
WARMUP_REQUESTS = 8  # the default; an 8B model on two cores takes minutes a request


class VllmServer(PeerProcess):
    """vLLM's OpenAI server from ``python``'s venv, healthy once constructed, in its own
    process group (vLLM runs its engine in a child process)."""

    def __init__(self, python: str, model_dir: Path, log_path: Path, kv_cache_gib: float,
                 omp_bind: str, start_timeout_s: float = 900.0) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self._log = open(log_path, "wb")
        flags = ["--dtype", "float32", "--seed", "0", "--served-model-name", SERVED_NAME]
        env = _env(kv_cache_gib, omp_bind)
        self.build = {"version": vllm_version(python), "flags": flags,
                      "env": {k: v for k, v in env.items() if k.startswith(("VLLM_", "OMP_"))}}
        self.proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], *flags,
             "--uvicorn-log-level", "warning"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        # in its own session a Ctrl-C would not reach it: closed on any failure to start
        wait_healthy(self, "vLLM's server", log_path, start_timeout_s, 1.0)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:  # already gone: nothing to pause, resume or stop
            pass


RATIO_KEYS = ("ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms", "itl_p99_ms")


def _summary(result) -> dict[str, Any]:
    m = result.metrics
    summary = {"completed": m.completed, "failed": m.failed, "duration_s": m.duration_s,
               "output_tok_s": m.output_throughput,
               "output_tokens": sum(r.output_len for r in result.records if r.success),
               **{f"{k}_{stat}_ms": s[stat] for k, s in m.latency_ms.items()
                  for stat in ("median", "p99")}}
    if m.failed:
        summary["errors"] = sorted({x.error for x in result.records if x.error})[:3]
    return summary


def serve_alternating(servers: dict[str, Any], pause: dict[str, Callable[[int], None]],
                      warmup: Sequence[BenchRequest], rounds: Sequence[Sequence[BenchRequest]],
                      request_rate: float, log_round: Callable[[int, dict], None],
                      stop_on_failure: bool = True,
                      watch: dict[str, CpuSampler] | None = None,
                      timeout_s: float = 300.0) -> dict[str, list[dict]]:
    """Warm each server up, then serve each round's requests on each server in turn,
    the others paused (``pause[name](signal)``), the order alternating by round; returns
    each server's summaries by round. A failed request raises, or with
    ``stop_on_failure=False`` is counted in its round's ``failed``, with the first
    errors. ``watch``: a CpuSampler per server, entered while that server is measured;
    ``timeout_s``: the longest a request may take, queueing included."""
    watch = watch or {}
    from kvserve.bench.instruments.serve import run_serve

    names = list(servers)

    def resume_only(name: str) -> None:
        for other in names:
            pause[other](signal.SIGCONT if other == name else signal.SIGSTOP)
        time.sleep(1.0)  # the resumed server's threads settle

    for name in names if warmup else ():
        resume_only(name)
        run_serve(warmup, base_url=servers[name].url, model=SERVED_NAME,
                  request_rate=float("inf"), timeout_s=timeout_s)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r, requests in enumerate(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            resume_only(name)
            with watch.get(name) or contextlib.nullcontext():
                res = run_serve(requests, base_url=servers[name].url, model=SERVED_NAME,
                                request_rate=request_rate, seed=r, timeout_s=timeout_s)
            runs[name].append(_summary(res))
            if stop_on_failure and res.metrics.failed:
                raise RuntimeError(f"{name}: {res.metrics.failed} requests failed: "
                                   + "; ".join(runs[name][-1]["errors"]))
        log_round(r, runs)
    return runs


def _figures(rounds: Sequence[dict], key: str) -> list[float | None]:
    """A server's ``key`` by round, None for a round in which a request failed."""
    return [None if r["failed"] else r[key] for r in rounds]


def paired_ratios(runs: dict[str, list[dict]], a: str, b: str) -> dict[str, PairedRatio | None]:
    """``a``'s latencies over ``b``'s, paired by round; a round in which either failed a
    request, or lacked the latency (ITL without a second token), is dropped from both."""
    return {key: paired_ratio(_figures(runs[a], key), _figures(runs[b], key))
            for key in RATIO_KEYS}


def start_peer(peer: str, model: Path, log_path: Path, kv_cache_gib: float,
               peer_binary: str):
    """The peer's server for ``model`` (vLLM: ``peer_binary`` is its venv's python and
    ``model`` a model directory; llama-server: its binary and a GGUF file)."""
    if peer == "vllm":
        return VllmServer(peer_binary, model, log_path, kv_cache_gib, "0-1")
    from kvserve.model.gguf import prepare_gguf

    return LlamaServer(peer_binary, model, prepare_gguf(model), log_path, kv_cache_gib)


def run_serving_bench(model_dir: Path, warmup: Sequence[BenchRequest],
                      rounds: Sequence[Sequence[BenchRequest]], engine_args: dict[str, Any],
                      peer_binary: str, request_rate: float, kv_cache_gib: float = 4.0,
                      log: Callable[[str], None] = print, peer: str = "vllm",
                      timeout_s: float = 300.0) -> dict[str, Any]:
    """``rounds``: each round's requests (both servers serve the same ones); ``peer``
    one of PEERS, started from ``peer_binary`` (see ``start_peer``); ``timeout_s``: the
    longest a request may take."""
    from kvserve.model.gguf import is_gguf

    if int(engine_args.get("tensor_parallel_size") or 1) > 1:
        raise ValueError("kvserve bench serving pauses one server process: run it without "
                         "tensor parallelism")
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; peers: {', '.join(PEERS)}")
    if peer == "llama-server" and not is_gguf(model_dir):
        raise ValueError(f"llama-server serves a GGUF file; {model_dir} is not one")

    def log_round(r: int, runs: dict[str, list[dict]]) -> None:
        ours, theirs = runs["kvserve"][-1], runs[peer][-1]
        failed = "".join(f"; {name} failed {x['failed']} requests ({'; '.join(x['errors'])})"
                         for name, x in (("kvserve", ours), (peer, theirs)) if x["failed"])
        log(f"  round {r + 1} of {len(rounds)}: P99 TPOT kvserve {ours['tpot_p99_ms']:.1f} ms, "
            f"{peer} {theirs['tpot_p99_ms']:.1f}; P99 TTFT {ours['ttft_p99_ms']:.0f} vs "
            f"{theirs['ttft_p99_ms']:.0f} ms" + failed)

    with tempfile.TemporaryDirectory(prefix="kvserve-serving-") as tmp:
        tmp_dir = Path(tmp)
        log("starting kvserve's server ...")
        kvserve = ServerProcess(model_dir, tmp_dir / "state", server_flags(engine_args),
                                tmp_dir / "kvserve.log")
        pause = {"kvserve": lambda sig: kvserve.proc.send_signal(sig)}
        servers = {"kvserve": kvserve}
        try:
            pause["kvserve"](signal.SIGSTOP)
            log(f"starting {peer}'s server ...")
            other = servers[peer] = start_peer(peer, model_dir, tmp_dir / f"{peer}.log",
                                               kv_cache_gib, peer_binary)
            pause[peer] = other.signal
            watch = {name: CpuSampler(server.proc.pid) for name, server in servers.items()}
            runs = serve_alternating(servers, pause, warmup, rounds, request_rate, log_round,
                                     stop_on_failure=False, watch=watch, timeout_s=timeout_s)
        finally:
            for name, server in servers.items():
                pause[name](signal.SIGCONT)
                server.close()
    if not any(not a["failed"] and not b["failed"] for a, b in zip(runs["kvserve"],
                                                                   runs[peer])):
        errors = {e for rs in runs.values() for r in rs for e in r.get("errors", [])}
        raise RuntimeError("no round completed on both servers: " + "; ".join(sorted(errors)[:3]))
    cpus = {name: sampler.usage for name, sampler in watch.items()}
    check_same_cpus(cpus)
    return {"request_rate": request_rate, "requests_per_round": len(rounds[0]),
            "request_timeout_s": timeout_s,
            "warmup_requests": len(warmup), "rounds": runs, "peer": peer,
            "kvserve_over_peer": paired_ratios(runs, "kvserve", peer),
            "peers": {peer: other.build},
            "cpus": {name: usage.to_dict() for name, usage in cpus.items()}}


def cmd_serving(args) -> int:
    """``kvserve bench serving``."""
    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir, workload_from_args
    from kvserve.bench.bench_setup import _header, _wl_settings, write_result_json
    from kvserve.bench.reports import report

    from kvserve.model.gguf import is_gguf, prepare_gguf

    peer_binary = args.vllm_python if args.peer == "vllm" else args.llama_server
    if not peer_binary:
        raise SystemExit("kvserve bench serving needs " + (
            "--vllm-python VENV/bin/python" if args.peer == "vllm" else
            "--llama-server PATH (llama.cpp's server binary)"))
    gguf = args.model is not None and is_gguf(args.model)
    model_dir = Path(args.model) if gguf else resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    per_round = args.num_prompts
    warm = args.warmup_requests
    args.num_prompts = warm + per_round * args.rounds  # fresh prompts a round
    wl = workload_from_args(args, prepare_gguf(model_dir) if gguf else model_dir)
    reqs = wl.requests
    rounds = [reqs[warm + r * per_round:warm + (r + 1) * per_round] for r in range(args.rounds)]
    info = _header("kvserve serving", {"model": model_dir.name, **_wl_settings(wl),
                                       "request_rate": args.request_rate,
                                       "engine_args": engine_args, "rounds": args.rounds})
    try:
        result = run_serving_bench(model_dir, reqs[:warm], rounds, engine_args,
                                   peer_binary, args.request_rate, args.peer_kv_cache_gib,
                                   peer=args.peer, timeout_s=args.request_timeout)
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"kvserve: error: {exc}") from None
    rows = []
    for name in ("kvserve", args.peer):  # each completed a round: run_serving_bench says so
        completed = [r for r in result["rounds"][name] if not r["failed"]]
        rows.append((name, *(statistics.median(r[k] for r in completed) for k in (
            "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms", "output_tok_s"))))
    print(report.format_table(["server", "TTFT median", "TTFT P99", "TPOT median",
                               "TPOT P99", "output tok/s"], rows))
    print(f"each server's median of the rounds it completed; kvserve / {args.peer}, paired by "
          "round (docs/statistics.md):")
    for key, ratio in result["kvserve_over_peer"].items():
        print(f"  {key}: {describe_ratio(ratio)}")
    if args.json:
        write_result_json(args.json, info, model_dir, wl, engine_args, result)
    return 0

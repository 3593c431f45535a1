"""``kvserve bench server-ab --flag NAME``: two kvserve servers, with and without one
boolean engine setting (``--async-scheduling``, ``--huge-pages``, ...), under the same
load at a low and a high concurrency.

Both servers are started once with the same settings but that flag, on loopback, and
warmed up. For each load, rounds alternate between them as ``bench serving``'s do (the
one not measured is paused): at ``--request-rate`` (the README's serving rate, few
requests at once) and with every request of the round sent at once (as many at once
as the round holds). Each round serves fresh requests. Reported per load: TTFT, TPOT,
ITL and output tok/s of each server by round, and on over off as the median of the
rounds' ratios (kvserve.bench.instruments.paired).
"""
from __future__ import annotations

import re
import signal
import statistics
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Sequence

from kvserve.bench.experiments.serving import paired_ratios, serve_alternating
from kvserve.bench.instruments.paired import describe_ratio, paired_ratio
from kvserve.bench.peers.server_process import ServerProcess, server_flags
from kvserve.bench.workloads.definitions import BenchRequest

MODES = ("off", "on")
WARMUP_REQUESTS = 8


def _kv_blocks(server: ServerProcess) -> int:
    """The server's KV pool size, from its cache_config_info series (it may be paused)."""
    server.proc.send_signal(signal.SIGCONT)
    try:
        text = server.http.get("/metrics").text
    finally:
        server.proc.send_signal(signal.SIGSTOP)
    return int(re.search(r'cache_config_info\{[^}]*num_kv_blocks="(\d+)"', text).group(1))


def run_server_ab_bench(model_dir: Path, warmup: Sequence[BenchRequest],
                        loads: dict[str, tuple[float, Sequence[Sequence[BenchRequest]]]],
                        engine_args: dict[str, Any], flag: str,
                        log: Callable[[str], None] = print) -> dict[str, Any]:
    """``loads``: name -> (request rate, each round's requests); ``flag``: the boolean
    engine setting (snake_case) the servers differ in."""
    from kvserve.engine.engine_args import EngineArgs

    field = next((f for f in fields(EngineArgs) if f.name == flag), None)
    if field is None or field.type not in (bool, "bool"):
        names = sorted(f.name for f in fields(EngineArgs) if f.type in (bool, "bool"))
        raise ValueError(f"--flag {flag!r} is not a boolean engine setting; one of {names}")
    if flag in engine_args:
        raise ValueError(f"the bench sets {flag} itself: leave that flag out")
    if int(engine_args.get("tensor_parallel_size") or 1) > 1:
        raise ValueError("kvserve bench server-ab pauses one server process: run it "
                         "without tensor parallelism")
    with tempfile.TemporaryDirectory(prefix="kvserve-ab-") as tmp:
        tmp_dir = Path(tmp)
        servers: dict[str, ServerProcess] = {}
        try:
            for mode in MODES:
                log(f"starting the {mode} server ...")
                flags = server_flags({**engine_args, flag: mode == "on"})
                servers[mode] = ServerProcess(model_dir, tmp_dir / f"state-{mode}", flags,
                                              tmp_dir / f"{mode}.log")
                servers[mode].proc.send_signal(signal.SIGSTOP)
            blocks = {m: _kv_blocks(servers[m]) for m in MODES}
            if len(set(blocks.values())) > 1:  # sized from the memory free at each start
                raise RuntimeError(f"the servers' KV pools differ ({blocks} blocks): set "
                                   "--kv-cache-memory or --num-kv-blocks")
            pause = {m: servers[m].proc.send_signal for m in MODES}
            out: dict[str, Any] = {}
            for name, (rate, rounds) in loads.items():
                def log_round(r: int, runs: dict[str, list[dict]], name=name, n=len(rounds)):
                    log(f"  {name}, round {r + 1} of {n}: median TPOT off "
                        f"{runs['off'][-1]['tpot_median_ms']:.2f} ms, on "
                        f"{runs['on'][-1]['tpot_median_ms']:.2f}; P99 TPOT "
                        f"{runs['off'][-1]['tpot_p99_ms']:.2f} vs "
                        f"{runs['on'][-1]['tpot_p99_ms']:.2f}")
                runs = serve_alternating(servers, pause, warmup if not out else [],
                                         rounds, rate, log_round)
                on_over_off = paired_ratios(runs, "on", "off")
                on_over_off["output_tok_s"] = paired_ratio(
                    [r["output_tok_s"] for r in runs["on"]],
                    [r["output_tok_s"] for r in runs["off"]])
                out[name] = {"request_rate": rate, "requests_per_round": len(rounds[0]),
                             "kv_blocks": blocks["off"], "flag": flag,
                             "rounds": runs, "on_over_off": on_over_off}
        finally:
            for server in servers.values():
                server.proc.send_signal(signal.SIGCONT)
                server.close()
    return out


def cmd_server_ab(args) -> int:
    """``kvserve bench server-ab``."""
    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir, workload_from_args
    from kvserve.bench.bench_setup import _header, _wl_settings, write_result_json
    from kvserve.bench.reports import report

    model_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    per_round, rounds = args.num_prompts, args.rounds
    args.num_prompts = WARMUP_REQUESTS + 2 * per_round * rounds  # fresh prompts a round
    wl = workload_from_args(args, model_dir)
    reqs = wl.requests[WARMUP_REQUESTS:]
    chunks = [reqs[i * per_round:(i + 1) * per_round] for i in range(2 * rounds)]
    loads = {f"rate {args.request_rate:g}/s": (args.request_rate, chunks[:rounds]),
             f"{per_round} at once": (float("inf"), chunks[rounds:])}
    flag = args.flag.replace("-", "_")
    info = _header(f"kvserve server-ab --flag {flag}", {
        "model": model_dir.name, **_wl_settings(wl), "request_rate": args.request_rate,
        "flag": flag, "engine_args": engine_args, "rounds": rounds})
    try:
        result = run_server_ab_bench(model_dir, wl.requests[:WARMUP_REQUESTS], loads,
                                     engine_args, flag)
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"kvserve: error: {exc}") from None
    keys = ("ttft_median_ms", "tpot_median_ms", "tpot_p99_ms", "output_tok_s")
    rows = []
    for name, res in result.items():
        for mode in MODES:
            rows.append((name, mode, *(statistics.median(r[k] for r in res["rounds"][mode])
                                       for k in keys)))
    print(report.format_table(["load", flag, "TTFT median", "TPOT median", "TPOT P99",
                               "output tok/s"], rows))
    for name, res in result.items():
        print(f"{name}: {flag} on / off, paired by round:")
        for key, ratio in res["on_over_off"].items():
            print(f"  {key}: {describe_ratio(ratio)}")
    if args.json:
        write_result_json(args.json, info, model_dir, wl, engine_args, result)
    return 0

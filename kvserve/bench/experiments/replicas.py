"""``kvserve bench replicas``: the Ray Serve form against the plain server, in one run.

1. What the ingress costs: the plain server and ``--replicas 1`` (the same engine
   settings on the same cores) take the same load (``kvserve bench serve``'s client)
   once untimed, then in alternating rounds (ABBA order); the figure is the median of
   the rounds' ratios of useful tokens per second (kvserve.bench.instruments.paired).
2. What routing keeps of the prefix cache: ``shared-prefix`` with several prefixes at a
   request rate, served by one engine, then by two replicas (each on its own core)
   routed cache-aware and round-robin. The hit rate is prefix-cache hits over queries,
   in tokens, from ``/metrics`` (summed over the replicas).

Ray binds more than loopback: on a shared machine run this in a private network
namespace (``unshare -n sh -c 'ip link set lo up && kvserve bench replicas ...'``).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any, Sequence

from kvserve.bench.instruments.paired import paired_ratio, ratio_cell
from kvserve.bench.peers.server_process import SERVED_NAME, ServerProcess, server_flags
from kvserve.bench.reports import report
from kvserve.bench.workloads.definitions import BenchRequest

HITS, QUERIES = "kvserve:prefix_cache_hits_total", "kvserve:prefix_cache_queries_total"


def _serve_round(server: ServerProcess, requests: Sequence[BenchRequest], rate: float,
                 seed: int) -> dict[str, Any]:
    from kvserve.bench.instruments.serve import run_serve

    hits, queries = server.counter_sum(HITS), server.counter_sum(QUERIES)
    result = run_serve(requests, base_url=server.url, model=SERVED_NAME, request_rate=rate,
                       seed=seed)
    m = result.metrics
    hits, queries = server.counter_sum(HITS) - hits, server.counter_sum(QUERIES) - queries
    return {"useful_tok_s": m.output_throughput, "completed": m.completed, "failed": m.failed,
            "p99_ttft_ms": m.latency_ms["ttft"]["p99"],
            "p99_tpot_ms": m.latency_ms["tpot"]["p99"],
            "prefix_hit_rate": hits / queries if queries else 0.0}


def ingress_cost(model_dir: Path, work: Path, flags: list[str],
                 requests: Sequence[BenchRequest], rounds: int) -> dict[str, Any]:
    servers = {"plain": ServerProcess(model_dir, work / "s-plain", flags, work / "plain.log"),
               "replicas_1": ServerProcess(model_dir, work / "s-ray1", [*flags, "--replicas",
                                                                     "1"], work / "ray1.log")}
    out: dict[str, list] = {name: [] for name in servers}
    try:
        for server in servers.values():  # a first pass fills allocators and caches
            _serve_round(server, requests, float("inf"), 0)
        for r in range(rounds):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]  # ABBA
            for name in order:
                out[name].append(_serve_round(servers[name], requests, float("inf"), r))
                print(f"round {r + 1}/{rounds} {name}: "
                      f"{out[name][-1]['useful_tok_s']:.1f} useful tok/s", flush=True)
    finally:
        for server in servers.values():
            server.close()
    return {"rounds": out, "replicas_1_over_plain": paired_ratio(
        _useful_tok_s(out["replicas_1"]), _useful_tok_s(out["plain"]))}


def _useful_tok_s(rounds: Sequence[dict[str, Any]]) -> list[float | None]:
    """A server's useful tok/s by round; None for a round in which a request failed (the
    round is dropped from both sides' ratio)."""
    return [None if r["failed"] else r["useful_tok_s"] for r in rounds]


def routing(model_dir: Path, work: Path, flags: list[str], requests: Sequence[BenchRequest],
            rate: float, seed: int) -> dict[str, Any]:
    settings = {"single_engine": flags,
                "replicas_2_cache_aware": [*flags, "--replicas", "2", "--threads-per-replica",
                                           "1", "--router", "cache_aware"],
                "replicas_2_round_robin": [*flags, "--replicas", "2", "--threads-per-replica",
                                           "1", "--router", "round_robin"]}
    out = {}
    for name, setting in settings.items():
        server = ServerProcess(model_dir, work / f"s-{name}", setting, work / f"{name}.log")
        try:
            out[name] = _serve_round(server, requests, rate, seed)
            if name != "single_engine":
                text = server.http.get("/metrics").text
                out[name]["routed"] = [line for line in text.splitlines()
                                       if line.startswith("kvserve:router_requests_total")]
        finally:
            server.close()
        print(f"{name}: prefix hit rate {out[name]['prefix_hit_rate']:.3f}, "
              f"{out[name]['useful_tok_s']:.1f} useful tok/s", flush=True)
    single = out["single_engine"]["prefix_hit_rate"]
    for name in settings:
        out[name]["hit_rate_vs_single"] = out[name]["prefix_hit_rate"] / single if single else 0.0
    return out


def cmd_replicas(args: argparse.Namespace) -> int:
    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir
    from kvserve.bench.bench_setup import _header
    from kvserve.bench.workloads.definitions import mixed_workload, shared_prefix_workload
    from kvserve.bench.workloads.models import model_vocab

    model_dir = resolve_model_dir(args.model)
    vocab, special = model_vocab(model_dir)
    load = mixed_workload(vocab, special, num_requests=args.num_prompts, seed=args.seed)
    shared = shared_prefix_workload(vocab, special, num_requests=args.prefix_requests,
                                    seed=args.seed, num_prefixes=args.num_prefixes)
    flags = server_flags(engine_args_from(args))
    info = _header("kvserve bench replicas", {
        "model": str(model_dir), "engine flags": " ".join(flags) or "(defaults)",
        "ingress load": f"mixed, {len(load.requests)} requests at once, {args.rounds} rounds",
        "routing load": f"shared-prefix, {args.num_prefixes} prefixes, "
                        f"{len(shared.requests)} requests at {args.prefix_rate} req/s"})
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-replicas-") as tmp:
        work = Path(tmp)
        cost = ingress_cost(model_dir, work, flags, load.requests, args.rounds)
        routed = routing(model_dir, work, flags, shared.requests, args.prefix_rate, args.seed)
    ratio = cost["replicas_1_over_plain"]
    rows = [("replicas 1 / plain server, useful tok/s", ratio_cell(ratio),
             f"median of {ratio.rounds if ratio else 0} rounds' ratios")]
    rows += [(f"{name}: prefix hit rate", f"{r['prefix_hit_rate']:.3f}",
              f"{r['hit_rate_vs_single']:.3f}x single engine") for name, r in routed.items()]
    print(report.format_table(["", "value", "detail"], rows))
    out = {"machine": info, "model": str(model_dir), "engine_flags": flags,
           "ingress_load": load.describe(), "routing_load": shared.describe(),
           "routing_request_rate": args.prefix_rate, "ingress_cost": cost, "routing": routed}
    if args.json:
        print(f"wrote {report.write_json(args.json, out)}")
    return 0


def add_replicas_parser(sub: Any) -> None:
    from kvserve.bench.bench_args import add_engine_args, add_output_args
    p = sub.add_parser("replicas", help="the Ray Serve form against the plain server: the "
                                        "ingress's cost, the router's prefix-cache hits")
    p.add_argument("--model", default=None, help="model directory (default: embedded)")
    p.add_argument("--num-prompts", type=int, default=64, help="mixed requests per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefix-requests", type=int, default=96)
    p.add_argument("--num-prefixes", type=int, default=24)
    p.add_argument("--prefix-rate", type=float, default=2.0, help="requests per second")
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p)
    add_output_args(p, plot=False)
    p.set_defaults(func=cmd_replicas)

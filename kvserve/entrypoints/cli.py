"""The ``kvserve`` command: serve, generate, bench."""
from __future__ import annotations

import argparse
import os
import sys

from kvserve.entrypoints.config_file import ConfigFileParser, add_config_argument

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams
    from kvserve.engine.engine_args import EngineArgs
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed,
                            stop=args.stop or None, n=args.n)
    prompts = args.prompt or [sys.stdin.read()]
    for out in llm.generate(prompts, params, use_tqdm=False):
        for completion in out.outputs:
            print(f"{out.prompt}{completion.text}")
            print(f"[finish_reason={completion.finish_reason}, "
                  f"{len(completion.token_ids)} tokens]", file=sys.stderr)
    return 0


def _add_generate(subparsers) -> None:
    from kvserve.engine.engine_args import EngineArgs
    p = subparsers.add_parser("generate", help="complete prompts offline and print the text")
    p.add_argument("prompt", nargs="*", help="prompt text (default: read stdin)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--sampling-seed", type=int, default=None)
    EngineArgs.add_cli_args(p)
    add_config_argument(p)
    p.set_defaults(func=_generate)


def _serve(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.openai.api_server import run_server
    return run_server(args)


def _add_serve(subparsers) -> None:
    from kvserve.engine.engine_args import EngineArgs
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    p.add_argument("model", nargs="?", default=None,
                   help="model directory in Hugging Face layout (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and tokenize routes "
                        "(default: $KVSERVE_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients use (default: the model directory's name)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="answer 429 while this many requests wait (default: 1024)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20,
                   help="largest request body; larger ones get 413 (default: 8 MiB)")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between throughput log lines; 0 disables (default: 10)")
    from kvserve.config.observability import METRICS_PREFIXES
    p.add_argument("--metrics-prefix", default="kvserve", choices=METRICS_PREFIXES,
                   help="name the Prometheus series kvserve:... or vllm:... (vLLM's own "
                        "dashboards and alerts then read them unchanged; default: kvserve)")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="send one OpenTelemetry span per request to this OTLP/HTTP "
                        "collector, e.g. http://127.0.0.1:4318/v1/traces (default: off)")
    p.add_argument("--state-dir", default=None,
                   help="where the Batch API keeps its database and files (default: "
                        "$XDG_CACHE_HOME/kvserve/state, else ~/.cache/kvserve/state)")
    p.add_argument("--max-batch-lines-in-flight", type=int, default=None,
                   help="batch lines in the engine at once while no realtime request is in "
                        "flight; fewer while some are (default: 2 x max_num_seqs)")
    p.add_argument("--max-batch-file-bytes", type=int, default=200 * 2**20,
                   help="largest file /v1/files accepts (default and OpenAI's limit: 200 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before "
                        "aborting them (default: 30)")
    p.add_argument("--disable-access-log", action="store_true",
                   help="do not log one line per HTTP request")
    from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
    p.add_argument("--tool-call-parser", default="hermes", choices=TOOL_PARSERS.names(),
                   help="how the model writes tool calls (default: hermes)")
    _add_replica_args(p)
    EngineArgs.add_cli_args(p, skip=("model",))
    add_config_argument(p)
    p.set_defaults(func=_serve)


def _add_replica_args(p: argparse.ArgumentParser) -> None:
    from kvserve.config.replicas import ReplicaConfig
    from kvserve.replicas.routers import ROUTERS
    d = ReplicaConfig()
    g = p.add_argument_group("replicas on Ray Serve (pip install 'kvserve[ray]')")
    g.add_argument("--replicas", type=int, default=None,
                   help="run N engine replicas as Ray Serve deployments behind one ingress "
                        "(default: one engine in this process, no Ray)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster from one of its nodes: auto or HOST:6379 "
                        "(default: start a local Ray)")
    g.add_argument("--router", default=d.router, choices=ROUTERS.names(),
                   help=f"how the ingress picks a replica (default: {d.router})")
    g.add_argument("--router-cache-threshold", type=float, default=d.cache_threshold,
                   help="route to the replica with the longest cached prefix when it covers "
                        f"at least this share of the prompt (default: {d.cache_threshold})")
    g.add_argument("--router-balance-abs-threshold", type=int,
                   default=d.balance_abs_threshold,
                   help="...unless that replica has more than this many requests above the "
                        f"least-loaded one (default: {d.balance_abs_threshold})")
    g.add_argument("--router-balance-rel-threshold", type=float,
                   default=d.balance_rel_threshold,
                   help="...and more than this times its load; then the least-loaded "
                        f"replica serves (default: {d.balance_rel_threshold})")
    g.add_argument("--threads-per-replica", type=int, default=None,
                   help="compute threads (and Ray CPUs) per replica, each replica on its "
                        "own cores (default: the cores divided among the replicas)")


def _run_batch(args: argparse.Namespace) -> int:
    from kvserve.batch.offline import run_batch_from_args
    return run_batch_from_args(args)


def _add_run_batch(subparsers) -> None:
    from kvserve.batch.offline import add_run_batch_args
    from kvserve.engine.engine_args import EngineArgs
    p = subparsers.add_parser("run-batch", help="run a Batch API input file (JSONL) offline "
                                                "and write the output file")
    add_run_batch_args(p)
    EngineArgs.add_cli_args(p, skip=("model",))
    add_config_argument(p)
    p.set_defaults(func=_run_batch)


def build_parser() -> argparse.ArgumentParser:
    parser = ConfigFileParser(prog="kvserve", description="kvserve: LLM inference engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_serve(subparsers)
    _add_run_batch(subparsers)
    _add_generate(subparsers)
    from kvserve.bench.cli import add_bench_parser
    add_bench_parser(subparsers)
    from kvserve.tune.cli import add_tune_parser
    add_tune_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

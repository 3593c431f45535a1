"""The ``kvserve`` command (serve, run-batch, generate, bench, tune): the top floor, the
one room that reaches every other; and :func:`engine_args_from_config`, which knows
every command's flags."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kvserve.bench.cli import add_bench_parser
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.entrypoints.config_file import (ConfigFileParser, add_config_argument,
                                             command_keys, read_engine_args)
from kvserve.entrypoints.openai.api_server import run_server
from kvserve.entrypoints.openai.run_batch import add_run_batch_args, run_batch_from_args
from kvserve.replicas.flags import add_serve_args, wants_replicas
from kvserve.replicas.launch import run_replicated_server
from kvserve.sampling_params import SamplingParams
from kvserve.tune.cli import add_tune_parser

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _generate(args: argparse.Namespace) -> int:
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
    return run_replicated_server(args) if wants_replicas(args) else run_server(args)


def _add_serve(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_serve_args(p)
    p.set_defaults(func=_serve)


def _run_batch(args: argparse.Namespace) -> int:
    return run_batch_from_args(args)


def _add_run_batch(subparsers) -> None:
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
    add_bench_parser(subparsers)
    add_tune_parser(subparsers)
    return parser


def engine_args_from_config(path: str | Path) -> dict[str, Any]:
    """The EngineArgs keyword arguments a config file sets, typed as the command line
    types them: ``LLM(**engine_args_from_config(p))``. The keys of other ``kvserve``
    flags (``port``, ``host``, ...) are left out, so a ``kvserve serve`` deployment's
    file works as is; a key that is no kvserve flag raises ``ConfigFileError``."""
    return read_engine_args(path, command_keys(build_parser()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

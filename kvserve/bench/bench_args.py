"""Argument groups shared by the ``kvserve bench`` sub-commands: engine flags,
workload selection and outputs, and turning parsed arguments back into values."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from kvserve.bench.workloads.definitions import WORKLOAD_NAMES, Workload, make_workload

__all__ = [
    "add_engine_args",
    "engine_args_from",
    "add_workload_args",
    "workload_from_args",
    "add_output_args",
    "resolve_model_dir",
    "parse_rate",
    "parse_value",
]

# Fallback engine flags (name, type) if kvserve.config.EngineArgs cannot generate them.
_FALLBACK_ENGINE_FLAGS: tuple[tuple[str, type], ...] = (
    ("max_num_seqs", int),
    ("max_num_batched_tokens", int),
    ("block_size", int),
    ("kv_manager", str),
    ("batching", str),
    ("dtype", str),
    ("num_kv_blocks", int),
    ("kv_cache_memory", str),
    ("max_model_len", int),
    ("num_threads", int),
)
# EngineArgs fields that bench owns itself (--model) or that would clash (--seed).
_SKIP = ("model", "seed")


def _engine_field_names() -> list[str]:
    try:
        from kvserve.engine.engine_args import EngineArgs

        return sorted(EngineArgs.field_names() - set(_SKIP))
    except (ImportError, AttributeError):
        return [name for name, _ in _FALLBACK_ENGINE_FLAGS]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags spelled like vLLM's (``--max-num-seqs``, ``--kv-manager``, ...),
    all defaulting to None so only the given ones reach the engine."""
    group = parser.add_argument_group("engine")
    try:
        from kvserve.engine.engine_args import EngineArgs

        EngineArgs.add_cli_args(group, skip=_SKIP)  # type: ignore[arg-type]
    except (ImportError, AttributeError):
        for name, kind in _FALLBACK_ENGINE_FLAGS:
            group.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    group.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other engine argument (value parsed as int/float when it looks like one)",
    )


def parse_value(text: str) -> Any:
    """A command-line value as bool, int or float when it reads as one, else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def engine_args_from(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments actually given on the command line (snake_case keys)."""
    out = {n: getattr(args, n) for n in _engine_field_names() if getattr(args, n, None) is not None}
    for item in getattr(args, "engine_arg", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg wants KEY=VALUE, got {item!r}")
        out[key.strip().replace("-", "_")] = parse_value(value.strip())
    return out


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """``--workload``, ``--num-prompts``, ``--input-len``, ``--output-len``, ``--seed``."""
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=WORKLOAD_NAMES,
        default=None,
        help="mixed (default), shared-prefix, or random (fixed --input-len/--output-len)",
    )
    g.add_argument("--num-prompts", type=int, default=None, help="override the request count")
    g.add_argument("--input-len", type=int, default=None, help="prompt length (random workload)")
    g.add_argument("--output-len", type=int, default=None, help="output length (random workload)")
    g.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix: how many distinct prefixes requests draw from "
                        "(default 1)")
    g.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="draw prompt ids below this (default: the model's vocabulary)",
    )


def add_output_args(parser: argparse.ArgumentParser, plot: bool = True) -> None:
    """``--json PATH`` and (optionally) ``--plot PATH``."""
    parser.add_argument("--json", default=None, metavar="PATH", help="write results as JSON")
    if plot:
        parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG plot")


def resolve_model_dir(model: str | None) -> Path:
    """The model directory: the given one, or the embedded default model."""
    if model is None:
        from kvserve.default_model import default_model_dir

        model = default_model_dir()
    path = Path(model)
    if not (path / "config.json").is_file():
        raise SystemExit(
            f"no config.json in {path}: pass --model DIR (e.g. built by "
            "`kvserve bench make-model bench-100m --out DIR`)"
        )
    return path


def workload_from_args(args: argparse.Namespace, model_dir: str | Path | None) -> Workload:
    """Build the workload the arguments ask for, from the model's vocabulary."""
    from kvserve.bench.workloads.models import model_vocab

    vocab: int | None = None
    special: list[int] = []
    if model_dir is not None and (Path(model_dir) / "config.json").is_file():
        vocab, special = model_vocab(model_dir)
    if args.vocab_size is not None:
        vocab = args.vocab_size if vocab is None else min(vocab, args.vocab_size)
    if vocab is None:
        raise SystemExit("no model directory to read the vocabulary from: pass --vocab-size")
    name = args.workload
    if name is None:
        name = "random" if (args.input_len or args.output_len) else "mixed"
    try:
        return make_workload(
            name, vocab, special, args.seed, args.num_prompts, args.input_len, args.output_len,
            getattr(args, "num_prefixes", 1))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def parse_rate(text: str) -> float:
    """A request rate: a positive number or ``inf``."""
    rate = float(text)
    if not (rate > 0 or math.isinf(rate)):
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return rate

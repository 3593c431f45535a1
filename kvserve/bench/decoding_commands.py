"""``kvserve bench spec`` and ``kvserve bench structured``: decoding features against the
same requests without them, in alternating rounds."""
from __future__ import annotations

import argparse
import json

from kvserve.bench.bench_args import engine_args_from, resolve_model_dir, workload_from_args
from kvserve.bench.bench_setup import _header, _wl_settings
from kvserve.bench.instruments.paired import describe_ratio, ratio_cell
from kvserve.bench.reports import report


DEFAULT_SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}


def cmd_spec(args: argparse.Namespace) -> int:
    """``kvserve bench spec``: speculative decoding on vs off."""
    from kvserve.bench.experiments import spec
    from kvserve.config.speculative import SpeculativeConfig
    from kvserve.model.tokenizer import Tokenizer

    model_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    config = engine_args.pop("speculative_config", None) or DEFAULT_SPEC_CONFIG
    try:
        SpeculativeConfig.from_value(config)
    except ValueError as exc:
        raise SystemExit(f"kvserve: error: {exc}") from None
    config = json.loads(config) if isinstance(config, str) else config
    if args.spec_workload:
        requests = spec.spec_workload(args.spec_workload, model_dir, Tokenizer(model_dir),
                                      args.num_prompts or 8, args.prompt_tokens,
                                      args.max_tokens)
        described = {"workload": args.spec_workload, "requests": len(requests),
                     "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens}
    else:
        wl = workload_from_args(args, model_dir)
        requests, described = wl.requests, _wl_settings(wl)
    mode = "batched" if args.batched else "single stream"
    info = _header("kvserve spec", {"model": model_dir.name, **described, "mode": mode,
                                    "speculative_config": config,
                                    "engine_args": engine_args, "rounds": args.rounds})
    result = spec.run_spec_bench(model_dir, requests, config, engine_args, args.rounds,
                                 not args.batched)
    print(report.format_table(
        ["mode", "off tok/s", "on tok/s", "speed-up", "acceptance", "mean accepted length"],
        [(mode, result["off_tok_s"], result["on_tok_s"], ratio_cell(result["speedup"]),
          result["acceptance_rate"] or 0.0, result["mean_acceptance_length"] or 1.0)]))
    print(f"speed-up, on / off: {describe_ratio(result['speedup'])}")
    print("verify step cost vs one row, k drafts: " + "  ".join(
        f"k={k}: {v:.2f}x" for k, v in result["verify_cost_vs_one_row"].items()))
    if args.json:
        out = {"machine": info, "model": model_dir.name, "settings": described, "mode": mode,
               "speculative_config": config,
               "engine_args": engine_args, "result": result}
        print(f"wrote {report.write_json(args.json, out)}")
    return 0


def cmd_structured(args: argparse.Namespace) -> int:
    """``kvserve bench structured``: json_schema-constrained vs unconstrained decoding."""
    from kvserve.bench.experiments.structured import run_structured_bench

    model_dir = resolve_model_dir(args.model)
    info = _header("kvserve structured", {"model": model_dir.name, "requests": args.num_prompts,
                                          "max_tokens": args.max_tokens, "rounds": args.rounds})
    result = run_structured_bench(args.model, args.num_prompts, args.max_tokens, args.rounds)
    print(report.format_table(
        ["unconstrained tok/s", "json_schema tok/s", "ratio", "mask us/token", "mask share",
         "waited share"],
        [(result["plain_tok_s"], result["constrained_tok_s"], ratio_cell(result["ratio"]),
          result["mask_us_per_token"] or 0.0, result["mask_share_of_run"] or 0.0,
          result["mask_wait_share_of_run"] or 0.0)]))
    print(f"json_schema / unconstrained tok/s: {describe_ratio(result['ratio'])}")
    if args.json:
        out = {"machine": info, "model": model_dir.name, "result": result}
        print(f"wrote {report.write_json(args.json, out)}")
    return 0

"""Handlers of the ``kvserve bench`` sub-commands: each reads parsed arguments, runs
one instrument, prints settings and results, and writes JSON / PNG when asked."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path
from typing import Any

from kvserve.core.batching import BATCHING_POLICIES
from kvserve.core.kv import KV_MANAGERS
from kvserve.bench.bench_args import engine_args_from, resolve_model_dir, workload_from_args
from kvserve.bench.bench_setup import _header, _wl_settings
from kvserve.bench.experiments import memory
from kvserve.bench.instruments.paired import describe_ratio, paired_ratio, ratio_cell
from kvserve.bench.reports import plots, report
from kvserve.worker import compute_thread

__all__ = ["cmd_make_model", "cmd_roofline", "cmd_throughput", "cmd_serve", "cmd_compare",
           "cmd_memory"]


def _int_list(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def cmd_make_model(args: argparse.Namespace) -> int:
    """``kvserve bench make-model NAME --out DIR``."""
    from kvserve.bench.workloads.models import BenchModelSpec, make_bench_model

    if args.name == "custom":
        dims = (args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads,
                args.intermediate_size)
        if None in dims:
            raise SystemExit("custom needs --hidden-size --num-layers --num-heads "
                             "--num-kv-heads --intermediate-size")
        name: Any = BenchModelSpec(*dims, vocab_size=args.vocab_size or 8192)
    else:
        name = args.name
    if args.format != "hf":
        from kvserve.bench.workloads.compressed_models import SAFETENSORS_FORMATS, \
            make_compressed_bench_model
        from kvserve.bench.workloads.gguf_models import make_gguf_bench_model
        from kvserve.bench.workloads.models import BENCH_MODELS
        from kvserve.default_model import default_model_dir

        if args.no_tokenizer:
            raise SystemExit(f"kvserve: error: --format {args.format} writes the tokenizer "
                             "beside the weights: --no-tokenizer applies to --format hf only")
        spec = name if isinstance(name, BenchModelSpec) else BENCH_MODELS[name]
        tokenizer_dir = Path(args.tokenizer_dir or default_model_dir())
        try:
            if args.format in SAFETENSORS_FORMATS:
                out = make_compressed_bench_model(spec, args.name, args.format,
                                                  Path(args.out), tokenizer_dir)
            else:
                out = make_gguf_bench_model(spec, args.name, args.format, Path(args.out),
                                            tokenizer_dir, args.llama_quantize)
        except (ValueError, RuntimeError) as exc:
            raise SystemExit(f"kvserve: error: {exc}") from None
    else:
        try:
            out = make_bench_model(name, args.out, args.tokenizer_dir,
                                   copy_tokenizer=not args.no_tokenizer)
        except ValueError as exc:
            raise SystemExit(f"kvserve: error: {exc}") from None
    print(f"wrote {args.name} to {out}")
    return 0


def cmd_roofline(args: argparse.Namespace) -> int:
    """``kvserve bench roofline``: measure the machine; bounds for ``--model`` if given."""
    from kvserve.bench.instruments import roofline as rl

    _header("roofline", {"threads": args.threads, "repeats": args.repeats, "ms": args.ms,
                         "k": args.k, "n": args.n, "cube": args.cube})
    res = rl.measure_roofline(args.threads, _int_list(args.ms), args.k, args.n, args.cube or None,
                              args.repeats)
    rows = [(shape, g) for shape, g in res.gemm_gflops.items()]
    print(report.format_table(["fp32 GEMM", "GFLOP/s"], rows))
    print(f"bandwidth: sum {res.sum_bandwidth_gbs:.1f} GB/s, GEMV {res.gemv_bandwidth_gbs:.1f} GB/s")
    peak = rl.gemm_peak([res])
    out: dict[str, Any] = {"machine": report.machine_info(), "roofline": res.to_dict(),
                           "gemm_peak": peak}
    if peak is not None:
        print(f"peak GEMM {peak.describe()}")
    if args.model:
        cfg = json.loads((Path(args.model) / "config.json").read_text())
        params = rl.matmul_params(cfg)
        floor = rl.decode_bandwidth_floor_s(params * 4, res.bandwidth_gbs)
        bound = rl.roofline_bound(params, 1, res.peak_gflops)
        bounds = {"matmul_params": params, "flops_per_token": rl.flops_per_token(params),
                  "gemm_bound_tok_s": bound["tokens_per_s"],
                  "batch1_decode_floor_ms": floor * 1e3,
                  "batch1_decode_ceiling_tok_s": 1.0 / floor if floor > 0 else None}
        report.print_settings(f"bounds for {args.model}", bounds)
        out["bounds"] = bounds
    if args.json:
        print(f"wrote {report.write_json(args.json, out)}")
    if args.plot:
        from kvserve.bench.reports.plots import plot_roofline

        print(f"wrote {plot_roofline(args.plot, res, report.machine_line(out['machine']))}")
    return 0


def cmd_throughput(args: argparse.Namespace) -> int:
    """``kvserve bench throughput``: kvserve offline throughput on a workload."""
    from kvserve.bench.instruments.throughput import load_llm, run_throughput

    model_dir = resolve_model_dir(args.model)
    wl = workload_from_args(args, model_dir)
    engine_args = engine_args_from(args)
    info = _header("kvserve throughput", {"model": model_dir.name, **_wl_settings(wl),
                                          "engine_args": engine_args, "repeats": args.repeats})
    try:
        llm, load_s = load_llm(model_dir, engine_args)
    except TypeError as exc:  # an engine argument the engine does not know
        raise SystemExit(f"kvserve: error: {exc}") from None
    runs = []
    for i in range(args.repeats):
        runs.append(run_throughput(model_dir, wl.requests, engine_args, llm=llm, progress=True))
        print(f"run {i + 1} of {args.repeats}: {runs[-1].useful_tok_s:.1f} useful tok/s "
              f"({runs[-1].wall_s:.1f} s)", flush=True)
    runs.sort(key=lambda r: r.useful_tok_s)
    res = runs[(len(runs) - 1) // 2]
    res.load_s = load_s
    print(report.format_table(
        ["wall s", "useful tok/s", "total tok/s", "req/s", "load s"],
        [(res.wall_s, res.useful_tok_s, res.total_tok_s, res.requests_per_s, load_s)]))
    out = {"machine": info, "model": model_dir.name, "workload": wl.describe(),
           "result": res.to_dict(), "repeat_useful_tok_s": [r.useful_tok_s for r in runs]}
    if args.json:
        print(f"wrote {report.write_json(args.json, out)}")
    if args.plot:
        from kvserve.bench.reports.plots import plot_compare

        row = {"name": "kvserve", **res.to_dict()}
        print(f"wrote {plot_compare(args.plot, [row], f'kvserve throughput: {wl.name}', report.machine_line(info))}")
    return 0


def _parse_slos(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    slos = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep:
            raise SystemExit(f"--goodput wants METRIC:MS (ttft, tpot, e2el), got {item!r}")
        slos[key.strip().lower()] = float(value)
    return slos


def cmd_serve(args: argparse.Namespace) -> int:
    """``kvserve bench serve``: load a running OpenAI-compatible server."""
    from kvserve.bench.instruments.serve import check_loopback, run_serve

    try:
        base = check_loopback(args.base_url)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    model_dir = None
    if args.vocab_size is None or args.model:
        model_dir = resolve_model_dir(args.model)
    wl = workload_from_args(args, model_dir)
    slos = _parse_slos(args.goodput)
    rate = args.request_rate
    info = _header("kvserve bench serve", {
        "base_url": base, "served_model_name": args.served_model_name, **_wl_settings(wl),
        "request_rate": rate, "max_concurrency": args.max_concurrency,
        "timeout_s": args.timeout, "max_duration_s": args.max_duration, "slos_ms": slos})
    res = run_serve(wl.requests, base_url=base, model=args.served_model_name, request_rate=rate,
                    max_concurrency=args.max_concurrency, timeout_s=args.timeout,
                    max_duration_s=args.max_duration, seed=args.seed, slos_ms=slos)
    m = res.metrics
    report.print_settings("results", {
        "successful requests": m.completed, "failed requests": m.failed,
        "skipped (max duration)": res.num_skipped, "duration s": m.duration_s,
        "input tokens": m.total_input_tokens, "output tokens": m.total_output_tokens,
        "request throughput req/s": m.request_throughput,
        "output token throughput tok/s": m.output_throughput,
        "total token throughput tok/s": m.total_token_throughput,
        "peak concurrency": m.peak_concurrency,
        **({"goodput req/s": m.goodput} if m.goodput is not None else {})})
    rows = [(k.upper(), s["mean"], s["median"], s["p99"]) for k, s in m.latency_ms.items()]
    print(report.format_table(["ms", "mean", "median", "P99"], rows))
    if m.failed:
        print("errors:", "; ".join(sorted({r.error for r in res.records if r.error})[:5]))
    out = {"machine": info, "workload": wl.describe(), **res.to_dict(args.save_detailed)}
    if args.json:
        print(f"wrote {report.write_json(args.json, out)}")
    if args.plot:
        from kvserve.bench.reports.plots import plot_serve

        print(f"wrote {plot_serve(args.plot, m, report.machine_line(info))}")
    return 0 if m.completed else 1


def _single_stream(args, model_dir, wl, engine_args, roofline) -> dict:
    """``--against llamacpp``: kvserve and llama.cpp on sequential requests."""
    from kvserve.bench.peers.llamacpp import run_single_stream

    if not args.llamacpp_python:
        raise SystemExit("--against llamacpp needs --llamacpp-python VENV/bin/python")
    print(f"running kvserve and llama.cpp on {args.sequential_requests} sequential requests ...")
    ss = run_single_stream(model_dir, wl.requests, engine_args, args.llamacpp_python,
                           args.llamacpp_gguf, args.llamacpp_source, args.sequential_requests,
                           args.repeats, roofline, llama_bench=args.llama_bench)
    rows = [(name, f"{statistics.median(r['decode_step_ms'] for r in rounds):.2f}",
             f"{statistics.median(r['decode_tok_s'] for r in rounds):.1f}",
             f"{statistics.median(r['sequential_output_tok_s'] for r in rounds):.1f}",
             f"{ss[name + '_vs_stream_floor']:.2f}x" if name + "_vs_stream_floor" in ss else "-")
            for name, rounds in ss["rounds"].items()]
    print(report.format_table(["single stream", "ms/step", "decode tok/s",
                               "sequential tok/s", "vs stream floor"], rows))
    ours, theirs = ss["rounds"]["kvserve"], ss["rounds"]["llamacpp"]
    for what, key in (("decode", "decode_tok_s"), ("sequential", "sequential_output_tok_s")):
        ratio = paired_ratio([r[key] for r in ours], [r[key] for r in theirs])
        print(f"kvserve / llama.cpp, {what} tok/s: {describe_ratio(ratio)}")
    print(f"greedy agreement on the first tokens: {100 * ss['token_agreement']:.0f} %")
    check = ss.get("llama_bench")
    if check:
        print(f"llama-bench tg{check['n_gen']}: {check['llama_bench_tg_tok_s']:.1f} tok/s, the "
              f"runner {check['runner_decode_tok_s']:.1f} "
              f"({check['runner_over_llama_bench']:.2f}x): "
              + ("agree within 10 %" if check["agree"] else check["why"]))
    split = ss["kvserve_profiled_step_ms"]
    if split:
        print("kvserve's profiled steps, ms: "
              + ", ".join(f"{part} {ms:.2f}" for part, ms in split.items()))
    return ss


def cmd_compare(args: argparse.Namespace) -> int:
    """``kvserve bench compare``: kvserve vs HF static (vs vLLM CPU) in one run."""
    from kvserve.bench.experiments.compare import parse_against, parse_variant, ratio_lines, \
        run_compare
    from kvserve.bench.instruments.roofline import RooflineResult, measure_roofline

    model_dir = resolve_model_dir(args.model)
    wl = workload_from_args(args, model_dir)
    engine_args = engine_args_from(args)
    try:
        against = parse_against(args.against)
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    sweep = _int_list(args.hf_sweep) if args.hf_sweep else []
    info = _header("kvserve bench compare", {
        "model": model_dir.name, **_wl_settings(wl), "engine_args": engine_args,
        "against": ",".join(against), "hf_batch_size": args.hf_batch_size, "hf_sweep": sweep,
        "hf_threads": args.hf_threads, "vllm_dtype": args.vllm_dtype, "repeats": args.repeats,
        "variants": {label: settings for label, settings in variants}})
    roof, remeasure = None, None
    if args.roofline_json:
        d = json.loads(Path(args.roofline_json).read_text())
        d = d.get("roofline", d)
        roof = RooflineResult(int(d["threads"]), dict(d["gemm_gflops"]),
                              float(d["sum_bandwidth_gbs"]), float(d["gemv_bandwidth_gbs"]),
                              f"read from {args.roofline_json}")
    elif not args.no_roofline:
        print("measuring roofline ...")
        # on kvserve's compute thread, where the engines will run: one OpenMP team
        roof = compute_thread().call(measure_roofline, threads=args.hf_threads, repeats=3,
                                     source="before the runs")
        remeasure = functools.partial(compute_thread().call, measure_roofline,
                                      threads=args.hf_threads, repeats=3,
                                      source="after the runs")
    try:
        out = run_compare(model_dir, wl.requests, against, engine_args, args.hf_batch_size, sweep,
                          args.hf_threads, args.vllm_python, args.vllm_kv_cache_gib,
                          args.vllm_dtype, roof, remeasure, args.repeats, variants=variants)
    except TypeError as exc:  # an engine argument the engine does not know
        if "engine argument" not in str(exc):
            raise
        raise SystemExit(f"kvserve: error: {exc}") from None
    rows = out["rows"]
    print(report.format_table(
        ["system", "wall s", "useful tok/s", "total tok/s", "req/s", "vs HF static", "vs vLLM",
         "roofline"],
        [(r["name"], r["wall_s"], r["useful_tok_s"], r["total_tok_s"], r["requests_per_s"],
          ratio_cell(r["vs_hf_static"]), ratio_cell(r["vs_vllm"]),
          "-" if r["roofline_share"] is None else f"{100 * r['roofline_share']:.1f}%")
         for r in rows]))
    print("ratios: of useful tok/s, the median of the rounds' ratios (min–max), "
          "docs/statistics.md")
    for line in ratio_lines(rows):
        print(line)
    if out["gemm_peak"] is not None:
        print(f"roofline: peak GEMM {out['gemm_peak'].describe()}, the best GEMM measured in "
              f"the run; workload {out['workload_flops'] / 1e12:.4g} TFLOP (the LM head only "
              f"where a token is sampled) -> GEMM-bound {out['gemm_bound_s']:.3g} s")
    print(_decode_line("kvserve", out["decode"]))
    for name, res in out["results"].items():
        if "decode" in res:
            print(_decode_line(name, res["decode"]))
    if "llamacpp" in against:
        out["single_stream"] = _single_stream(args, model_dir, wl, engine_args, out["roofline"])
    for note in out["notes"]:
        print("note:", note)
    full = {"machine": info, "model": model_dir.name, "workload": wl.describe(),
            "engine_args": engine_args, **out}
    if args.json:
        print(f"wrote {report.write_json(args.json, full)}")
    if args.plot:
        from kvserve.bench.reports.plots import plot_compare

        title = f"{Path(model_dir).name} / {wl.name}: useful and total tok/s"
        print(f"wrote {plot_compare(args.plot, rows, title, report.machine_line(info))}")
    return 0


def _decode_line(name: str, dec: dict) -> str:
    """One line on a single-stream decode measurement and its bandwidth floors."""
    line = (f"single-stream decode, {name}: {1000 * dec['median_step_s']:.1f} ms/step "
            f"({dec['tok_s']:.1f} tok/s), {dec['weight_bytes'] / 1e6:.0f} MB of matmul weights")
    if "vs_gemv_floor" in dec:
        line += (f"; {dec['vs_gemv_floor']:.2f}x the GEMV-bandwidth floor "
                 f"({1000 * dec['gemv_floor_s']:.1f} ms), {dec['vs_stream_floor']:.2f}x the "
                 f"streaming-read floor ({1000 * dec['stream_floor_s']:.1f} ms)")
    return line


def cmd_memory(args: argparse.Namespace) -> int:
    model_dir = resolve_model_dir(args.model)
    wl = workload_from_args(args, model_dir)
    engine_args = engine_args_from(args)
    for name in ("kv_manager", "batching", "num_kv_blocks", "kv_cache_memory"):
        if name in engine_args:
            raise SystemExit(f"bench memory sweeps kv_manager and batching under --kv-budget; "
                             f"drop --{name.replace('_', '-')}")
    # the designs should differ only in memory layout: prefix caching is paged-only
    engine_args.setdefault("enable_prefix_caching", False)
    block_size = engine_args.get("block_size", 16)
    bytes_per_block = _bytes_per_block(model_dir, block_size, engine_args.get("dtype", "auto"))
    try:
        num_blocks = memory.parse_kv_budget(args.kv_budget, wl, block_size, bytes_per_block)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    designs = memory.kv_designs(model_dir, _names(args.kv_managers, KV_MANAGERS.names()),
                                num_blocks)
    combos = [(kv, b) for kv in designs
              for b in _names(args.batchings, BATCHING_POLICIES.names())]
    need = sum(r.prompt_len + r.max_tokens for r in wl.requests)
    settings = {"model": model_dir.name, "workload": wl.name, "requests": len(wl),
                "prompt_tokens": wl.num_prompt_tokens, "output_tokens": wl.num_output_tokens,
                "kv_budget": f"{args.kv_budget} = {num_blocks} blocks x {block_size} = "
                             f"{num_blocks * block_size} tokens "
                             f"({num_blocks * block_size / need:.0%} of the {need} the "
                             "workload holds at once)",
                "engine_args": engine_args, "dry_run": args.dry_run}
    report.print_settings("kvserve bench memory", settings)
    info = report.machine_info()
    print(report.machine_line(info))
    rounds: list[list[memory.MemoryResult]] = []
    for i in range(1 if args.dry_run else args.repeats):
        if args.repeats > 1 and not args.dry_run:
            print(f"round {i + 1} of {args.repeats}", flush=True)
        done: dict[tuple[str, str], memory.MemoryResult] = {}
        for kv, b in combos if i % 2 == 0 else combos[::-1]:  # alternate: drift cancels
            manager, extra, blocks = designs[kv]
            res = memory.run_combo(model_dir, wl.requests, manager, b, blocks,
                                   {**engine_args, **extra}, args.dry_run, progress=True,
                                   label=kv, bytes_per_block=bytes_per_block and
                                   bytes_per_block * num_blocks // blocks)
            done[kv, b] = res
            print(f"  {kv:10s} {b:13s} util {memory.pct(res.kv_utilization):>7s}  "
                  f"ext {memory.pct(res.external_fragmentation):>7s}  "
                  f"peak {res.peak_running:3d}  "
                  f"preempt {res.preemptions:4d}  moved {res.moved_blocks:5d}  "
                  f"recomputed {memory.pct(res.recompute_overhead):>7s}  steps {res.steps:5d}  "
                  f"tok/s {memory.num_or_dash(res.output_tok_s, '.1f')}  "
                  f"tok/CPU-s {memory.num_or_dash(res.output_tok_per_cpu_s, '.1f')}  "
                  f"p99 {memory.num_or_dash(res.p99_latency_s, '.1f')} s", flush=True)
        rounds.append([done[c] for c in combos])
        # write after every round: a long run keeps what it measured
        _write_outputs(args, info, model_dir, wl, settings, num_blocks, block_size, rounds,
                       final=i + 1 == (1 if args.dry_run else args.repeats))
    return 0


def _write_outputs(args: argparse.Namespace, info: dict[str, Any], model_dir: Path,
                   wl: Any, settings: dict[str, Any], num_blocks: int, block_size: int,
                   rounds: list[list[memory.MemoryResult]], final: bool) -> None:
    results = memory.combine_rounds(rounds)
    first = f"{results[0].kv_manager}/{results[0].batching}" if results else "-"
    context = (f"Workload `{wl.name}`, {len(wl)} requests, KV budget {num_blocks} blocks x "
               f"{block_size} tokens"
               + (", dry run (no model: memory figures only)" if args.dry_run else
                  f", {len(rounds)} round(s): medians; tok/s ratio is to {first} in the "
                  "same round")
               + f";\n{report.machine_line(info)}")
    md = memory.format_markdown(results, context)
    if final:
        print(md)
    out = {"machine": info, "model": model_dir.name, "workload": wl.describe(),
           "settings": settings, "kv_blocks": num_blocks, "block_size": block_size,
           "rounds": [[r.to_dict() for r in rnd] for rnd in rounds],
           "results": [r.to_dict() for r in results]}
    say = print if final else (lambda *a, **k: None)
    if args.json:
        say(f"wrote {report.write_json(args.json, out)}")
    md_path = args.markdown or (str(Path(args.json).with_suffix(".md")) if args.json else None)
    if md_path:
        Path(md_path).parent.mkdir(parents=True, exist_ok=True)
        Path(md_path).write_text(md + "\n")
        say(f"wrote {md_path}")
    if args.plot:
        say(f"wrote {plots.plot_memory(args.plot, results, context)}")


def _names(text: str, allowed: tuple[str, ...]) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(f"choose from {', '.join(allowed)}; got {text!r}")
    return names


def _bytes_per_block(model_dir: Path, block_size: int, dtype: str) -> int | None:
    try:
        from kvserve.model.registry import read_arch_config
        from kvserve.model.loader import resolve_dtype
        from kvserve.worker.model_runner import kv_bytes_per_block

        cfg = read_arch_config(model_dir)
        return kv_bytes_per_block(cfg, block_size, resolve_dtype(dtype, cfg))
    except Exception:  # only needed for a size budget; parse_kv_budget says so if missing
        return None


"""``kvserve bench huge-pages``: weights and KV pools on huge pages against torch's pages.

Two engines of the same settings, one with ``--huge-pages`` (the default) and one with
``--no-huge-pages``, in alternating rounds. Each round decodes 1, 8 and 32 requests at
once on each engine and times the engine's decode steps (both engines capture the same
row counts), then runs the whole workload through each engine's ``generate``. The
prompts are the workload's first ones of 256 tokens or more, cut to 256: 32 of them read
about as many bytes of KV a step as of weights. Every round also measures a large ``sum``
over each kind of memory, the streaming read each engine's weights can at best be read
at. Each figure of huge pages against torch's is the median of the rounds' ratios.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

from kvserve.bench.instruments.decode import concurrent_decode_steps
from kvserve.bench.instruments.paired import describe_ratio, paired_ratio, ratio_cell
from kvserve.bench.workloads.definitions import BenchRequest

CONCURRENCY = (1, 8, 32)
PROMPT_TOKENS = 256
NEW_TOKENS = 64
MODES = ("huge", "torch")  # huge pages, torch's allocations
MODE_ARGS = {"huge": True, "torch": False}


def _round(engines, prompts, r: int, order, runs, tag: str) -> None:
    """Each concurrency on both engines back to back (the pair close in time: this
    machine's speed drifts within seconds)."""
    for c in CONCURRENCY:
        for mode in order:
            engines[mode].reset_prefix_cache()
            steps = concurrent_decode_steps(engines[mode], prompts[:c],
                                            f"{tag}-{mode}-{r}-{c}", NEW_TOKENS)
            runs[mode][c].append(statistics.median(steps))


def _workload_tok_s(llm, requests) -> float:
    """Useful output tokens per second of one ``generate`` over the workload."""
    from kvserve.bench.instruments.throughput import count_output_tokens, generate_timed

    llm.engine.reset_prefix_cache()
    seconds, outputs = generate_timed(llm, requests)
    return count_output_tokens(requests, outputs)[0] / seconds


def _same_captured_rows(engines) -> int:
    """Both engines' captured steps cover the row counts either chose at start: each
    engine times its own, and a row count captured on one side only would be
    measured instead of the pages."""
    steps = [e.worker.runner.captured for e in engines.values()]
    rows = min(0 if s is None else s.max_rows for s in steps)
    for step in steps:
        if step is not None:
            step.max_rows = rows
    return rows


def run_huge_pages_bench(model_dir: str, requests: Sequence[BenchRequest],
                         engine_args: dict[str, Any], rounds: int,
                         log: Callable[[str], None] = print) -> dict[str, Any]:
    from kvserve.bench.instruments.roofline import measure_apart
    from kvserve.bench.instruments.throughput import load_llm
    from kvserve.worker.huge_pages import huge_pages_available, huge_pages_setting

    if not huge_pages_available():
        raise ValueError(f"the kernel offers no transparent huge pages here "
                         f"({huge_pages_setting()}): there is nothing to compare")
    if huge_pages_setting() != "madvise":
        raise ValueError(f"transparent huge pages are '{huge_pages_setting()}' here: torch's "
                         "large allocations get huge pages too, so there is no baseline "
                         "on small pages (the bench needs 'madvise')")
    if engine_args.get("tensor_parallel_size", 1) > 1:
        raise ValueError("kvserve bench huge-pages compares one process's engines: run it "
                         "without tensor parallelism")
    if "huge_pages" in engine_args:
        raise ValueError("kvserve bench huge-pages sets --huge-pages itself, one engine "
                         "each way")
    prompts = [list(r.prompt_token_ids[:PROMPT_TOKENS]) for r in requests
               if r.prompt_len >= PROMPT_TOKENS][:max(CONCURRENCY)]
    if len(prompts) < max(CONCURRENCY):
        raise ValueError(f"the workload needs {max(CONCURRENCY)} requests of at least "
                         f"{PROMPT_TOKENS} prompt tokens; it has {len(prompts)}")
    llms, engines, start_s = {}, {}, {}
    try:
        for mode in MODES:
            llms[mode], start_s[mode] = load_llm(model_dir, {**engine_args,
                                                             "huge_pages": MODE_ARGS[mode]})
            engines[mode] = llms[mode].engine
            if engines[mode].worker.huge_pages != MODE_ARGS[mode]:
                raise ValueError(f"the {mode} engine did not start as asked")
        captured_rows = _same_captured_rows(engines)
        log("engines ready in " + ", ".join(f"{m} {s:.1f}s" for m, s in start_s.items())
            + (f"; both capture steps of 1-{captured_rows} rows" if captured_rows
               else "; no captured steps"))
        warm = {m: {c: [] for c in CONCURRENCY} for m in MODES}
        _round(engines, prompts, 0, MODES, warm, "warm")
        for mode in MODES:
            _workload_tok_s(llms[mode], requests[:16])
        tok_s: dict[str, list[float]] = {m: [] for m in MODES}
        runs: dict[str, dict[int, list[float]]] = {m: {c: [] for c in CONCURRENCY}
                                                   for m in MODES}
        bandwidth: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                bandwidth[mode].append(measure_apart("measure_sum_bandwidth",
                                                           huge_pages=mode == "huge"))
            _round(engines, prompts, r, order, runs, "run")
            for mode in order:
                tok_s[mode].append(_workload_tok_s(llms[mode], requests))
            log(f"  round {r + 1} of {rounds}: " + "; ".join(
                f"{c} at once {1000 * runs['torch'][c][-1]:.2f} -> "
                f"{1000 * runs['huge'][c][-1]:.2f} ms" for c in CONCURRENCY)
                + f"; workload {tok_s['torch'][-1]:.1f} -> {tok_s['huge'][-1]:.1f} tok/s"
                + "; sum " + " -> ".join(f"{bandwidth[m][-1]:.1f}" for m in MODES[::-1])
                + " GB/s")
    finally:
        for engine in engines.values():
            engine.close()
    return {"engine_start_s": start_s, "captured_rows": captured_rows, "rounds": rounds,
            "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
            **huge_over_torch(runs, tok_s, bandwidth)}


def huge_over_torch(runs: dict[str, dict[int, list[float]]], tok_s: dict[str, list[float]],
                    bandwidth: dict[str, list[float]]) -> dict[str, Any]:
    """The figures of the rounds' measurements (each mode's step seconds by concurrency,
    workload tok/s and ``sum`` GB/s, by round): each side's medians, and huge pages
    against torch's as the median of the rounds' ratios (kvserve.bench.instruments.paired)."""
    return {
        "step_ms": {m: {c: 1000 * statistics.median(runs[m][c]) for c in CONCURRENCY}
                    for m in MODES},
        "round_step_ms": {m: {c: [1000 * s for s in runs[m][c]] for c in CONCURRENCY}
                          for m in MODES},
        # torch's step over huge pages' step
        "speedup": {c: paired_ratio(runs["torch"][c], runs["huge"][c]) for c in CONCURRENCY},
        # the whole workload through generate, useful output tokens a second
        "round_workload_tok_s": tok_s,
        "workload_speedup": paired_ratio(tok_s["huge"], tok_s["torch"]),
        "round_sum_bandwidth_gbs": bandwidth,
        "sum_bandwidth_ratio": paired_ratio(bandwidth["huge"], bandwidth["torch"]),
    }


def cmd_huge_pages(args) -> int:
    """``kvserve bench huge-pages``: decode steps on huge pages against torch's pages."""
    from kvserve.bench.bench_setup import rounds_bench_setup, write_result_json
    from kvserve.bench.reports import report

    model_dir, engine_args, wl, info = rounds_bench_setup(args, "kvserve huge-pages")
    try:
        result = run_huge_pages_bench(str(model_dir), wl.requests, engine_args, args.rounds)
    except ValueError as exc:
        raise SystemExit(f"kvserve: error: {exc}") from None
    print(report.format_table(
        ["requests at once", "torch pages ms/step", "huge pages ms/step", "speed-up"],
        [(c, result["step_ms"]["torch"][c], result["step_ms"]["huge"][c],
          ratio_cell(result["speedup"][c])) for c in CONCURRENCY]))
    tok = result["round_workload_tok_s"]
    print(f"workload ({len(wl.requests)} requests), useful tok/s: torch's pages "
          f"{statistics.median(tok['torch']):.1f}, huge pages "
          f"{statistics.median(tok['huge']):.1f}; huge pages over torch's "
          f"{describe_ratio(result['workload_speedup'])}")
    print("streaming read, huge pages over torch's: "
          f"{describe_ratio(result['sum_bandwidth_ratio'])}")
    if args.json:
        write_result_json(args.json, info, model_dir, wl, engine_args, result)
    return 0

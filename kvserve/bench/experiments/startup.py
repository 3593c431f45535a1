"""``kvserve bench startup``: an engine's start with its tuning plan saved against one
that measures every choice.

Each round starts the engine twice, in alternating order: once measuring every start-up
choice (``--no-tuning-cache``), once loading the plan a first, unmeasured start saved
(``--tuning-plan``). Each start is timed from ``LLM(...)`` to an engine ready for
requests, loading included, and the figure is the median of the rounds' ratios. Every
planned start must run the saved plan's kernels (checked on the layers); how many of
the measuring starts chose that same plan shows how much the choices move with the
machine's noise. A GGUF file's conversion (config and tokenizer from its metadata, once
per file) is timed on its own, into a scratch folder, and made before the starts.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from kvserve.bench.instruments.paired import describe_ratio, paired_ratio

MODES = ("measured", "planned")


def _start(model_dir: str, engine_args: dict[str, Any], mode: str, plan_path: Path
           ) -> tuple[float, Any]:
    """(seconds to a ready engine, the plan it ran) for one start in ``mode``."""
    from kvserve.bench.instruments.throughput import load_llm

    extra = ({"tuning_cache": False} if mode == "measured"
             else {"tuning_plan": str(plan_path), "tuning_cache": False})
    llm, seconds = load_llm(model_dir, {**engine_args, **extra})
    try:
        return seconds, llm.engine.worker.tuning_plan()
    finally:
        llm.engine.close()


def run_startup_bench(model_dir: str, engine_args: dict[str, Any], rounds: int,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    for name in ("tuning_plan", "tuning_cache"):
        if name in engine_args:
            raise ValueError(f"kvserve bench startup sets --{name.replace('_', '-')} itself, "
                             "one start each way")
    with tempfile.TemporaryDirectory(prefix="kvserve-startup-") as tmp:
        plan_path = Path(tmp) / "plan.json"
        first_s, _ = _start(model_dir, engine_args, "measured", plan_path)
        _, saved = _start(model_dir, engine_args, "planned", plan_path)  # measures, saves
        log(f"first start {first_s:.1f}s; the plan saved:\n  "
            + saved.describe().replace("\n", "\n  "))
        seconds: dict[str, list[float]] = {m: [] for m in MODES}
        same_as_saved: dict[str, list[bool]] = {m: [] for m in MODES}
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                s, plan = _start(model_dir, engine_args, mode, plan_path)
                seconds[mode].append(s)
                same_as_saved[mode].append(plan.to_dict() == saved.to_dict())
            log(f"  round {r + 1} of {rounds}: measured {seconds['measured'][-1]:.2f}s, "
                f"planned {seconds['planned'][-1]:.2f}s")
    if not all(same_as_saved["planned"]):
        raise RuntimeError("a start given the saved plan ran other choices than the plan's")
    return {"rounds": rounds, "round_start_s": seconds,
            "speedup": paired_ratio(seconds["measured"], seconds["planned"]),
            "measured_starts_choosing_the_saved_plan": sum(same_as_saved["measured"]),
            "plan": saved.to_dict()}


def cmd_startup(args) -> int:
    """``kvserve bench startup``: engine start with a saved tuning plan vs measuring."""
    import statistics

    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir
    from kvserve.bench.bench_setup import _header
    from kvserve.bench.reports import report
    from kvserve.model.gguf import is_gguf, prepare_gguf

    conversion_s = None
    if args.model is not None and is_gguf(args.model):
        with tempfile.TemporaryDirectory(prefix="kvserve-gguf-") as tmp:
            start = time.perf_counter()
            prepare_gguf(args.model, root=Path(tmp))
            conversion_s = time.perf_counter() - start
        prepare_gguf(args.model)  # the starts then find it converted
        print(f"the GGUF file's conversion: {conversion_s:.1f}s (once per file)")
        model_dir = Path(args.model)
    else:
        model_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    info = _header("kvserve startup", {"model": model_dir.name, "engine_args": engine_args,
                                       "rounds": args.rounds})
    try:
        result = run_startup_bench(str(model_dir), engine_args, args.rounds)
    except ValueError as exc:
        raise SystemExit(f"kvserve: error: {exc}") from None
    if conversion_s is not None:
        result["gguf_conversion_s"] = conversion_s
    s = result["round_start_s"]
    print(f"start to a ready engine, median: measuring {statistics.median(s['measured']):.2f}s, "
          f"with the saved plan {statistics.median(s['planned']):.2f}s; measuring over "
          f"planned {describe_ratio(result['speedup'])}")
    print(f"measuring starts that chose the saved plan's kernels: "
          f"{result['measured_starts_choosing_the_saved_plan']} of {args.rounds}")
    if args.json:
        out = {"machine": info, "model": model_dir.name, "engine_args": engine_args,
               "result": result}
        print(f"wrote {report.write_json(args.json, out)}")
    return 0

"""``kvserve tune``: search engine settings for a workload under SLOs, in one process.

Writes the best settings as a YAML file of flag names (``kvserve serve --config``), the
Pareto front (throughput against P99 TTFT and P99 TPOT) as JSON and a PNG, and prints
every measured candidate with the tuning guide's diagnostics. At the end the defaults
and the best settings are measured again, alternately, so the gain is a same-run ratio.
The whole run ends within ``--budget-s`` (:mod:`kvserve.tune.budget`).
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

from kvserve.tune.budget import REPORT_RESERVE_S, Budget, process_started
from kvserve.tune.search import Slos, Trial, Tuner, pareto_front

DEFAULTS: dict = {}  # the engine's own defaults: no setting changed


def add_tune_parser(subparsers) -> None:
    from kvserve.bench.workloads.definitions import WORKLOAD_NAMES

    p = subparsers.add_parser("tune", help="search engine settings for a workload under SLOs")
    p.add_argument("model", nargs="?", default=None,
                   help="model directory (default: the embedded model)")
    p.add_argument("--workload", default="mixed",
                   help=f"{' | '.join(WORKLOAD_NAMES)} or a JSONL file of "
                        "{\"prompt_token_ids\": [...], \"max_tokens\": N} (default: mixed)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (default 64)")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    load.add_argument("--max-concurrency", type=int,
                      help="a closed loop instead: this many requests in flight, the next "
                           "sent when one finishes")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument("--objective", choices=("goodput", "throughput"), default="goodput")
    p.add_argument("--budget-s", type=float, default=600.0,
                   help="seconds the whole run may take, loading, search, final "
                        "re-measurement and report (default 600); a budget too small "
                        "for one candidate is refused, naming the least that would do")
    p.add_argument("--kv-cache-memory", default="1GiB",
                   help="KV pool of every candidate (default 1GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="tuned.yaml", help="best settings (default tuned.yaml)")
    p.add_argument("--tuning-plan", default=None, metavar="PATH",
                   help="also write the best settings' tuning plan (the kernels start-up "
                        "chose for them on this machine) to PATH, replacing what is there; "
                        "the settings file then names it, so a server started with "
                        "--config loads it instead of measuring")
    p.add_argument("--plot", default=None, help="Pareto front PNG")
    p.add_argument("--json", default=None, help="every candidate and the front, as JSON")
    p.set_defaults(func=run_tune)


def _requests(args, model_dir):
    from kvserve.bench.workloads.definitions import BenchRequest, WORKLOAD_NAMES, make_workload
    from kvserve.bench.workloads.models import model_vocab

    if args.workload in WORKLOAD_NAMES:
        vocab, special = model_vocab(model_dir)
        return make_workload(args.workload, vocab, special, args.seed, args.num_prompts).requests
    path = Path(args.workload)
    if not path.is_file():
        raise ValueError(f"--workload must be one of {list(WORKLOAD_NAMES)} or a JSONL file; "
                         f"{args.workload!r} is neither")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [BenchRequest(list(r["prompt_token_ids"]), int(r["max_tokens"]))
            for r in rows][:args.num_prompts]


def _flags(settings: dict) -> dict:
    """Settings by their EngineArgs names: ``kvserve serve --config`` reads them (as it
    reads the dashed flag names) and so does ``LLM(**yaml.safe_load(...))``."""
    from kvserve.tune.search import engine_args_of
    return engine_args_of(settings)


def _row(t: Trial) -> str:
    if t.error:
        return f"  {json.dumps(t.settings)}: failed: {t.error}"
    return (f"  goodput {t.goodput:6.2f} req/s  {t.throughput:8.1f} tok/s  P99 TTFT "
            f"{t.p99_ttft_ms:7.1f} ms  P99 TPOT {t.p99_tpot_ms:6.2f} ms  {json.dumps(t.settings)}")


def _plot(path: str, trials: list[Trial], front: list[Trial]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [t for t in trials if not t.error]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "p99_ttft_ms", "P99 TTFT (ms)"),
                           (axes[1], "p99_tpot_ms", "P99 TPOT (ms)")):
        ax.scatter([getattr(t, key) for t in ok], [t.throughput for t in ok], s=14,
                   color="#9aa5b1", label="candidates")
        ax.scatter([getattr(t, key) for t in front], [t.throughput for t in front], s=28,
                   color="#d9480f", label="Pareto front")
        ax.scatter([getattr(ok[0], key)], [ok[0].throughput], marker="x", s=60,
                   color="#1c7ed6", label="defaults")
        ax.set_xlabel(label)
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gain_vs_defaults(again: dict[str, list[float]], defaults: Trial, best: Trial,
                     score) -> tuple[float, str]:
    """Best over defaults: the ratio of the re-measured medians, or, when the budget left
    no re-measurement of one of them, of the search's own measurements (said so)."""
    if again["defaults"] and again["best"]:
        ratio = statistics.median(again["best"]) / max(1e-9, statistics.median(
            again["defaults"]))
        return ratio, f"re-measured ({len(again['defaults'])} + {len(again['best'])} runs)"
    return (score(best) / max(1e-9, score(defaults)),
            "not re-measured (no time left in the budget): from the search's runs")


def run_tune(args: argparse.Namespace) -> int:
    budget = Budget(args.budget_s, started=process_started())  # the imports count too
    import yaml
    from tqdm import tqdm

    from kvserve.bench.bench_args import resolve_model_dir
    from kvserve.bench.reports.report import machine_info, machine_line
    from kvserve.bench.workloads.definitions import poisson_arrival_times

    import logging
    logging.getLogger("kvserve").setLevel(logging.WARNING)  # a start-up log per candidate
    if args.plot:  # imported now, inside the budget, so that the report itself is quick
        import matplotlib.pyplot  # noqa: F401
    model_dir = resolve_model_dir(args.model)
    requests = _requests(args, model_dir)
    if args.max_concurrency is not None:
        if args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        arrivals = None
    else:
        if not args.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
        arrivals = poisson_arrival_times(len(requests), args.request_rate, args.seed)
    slos = Slos(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    info = machine_info()
    print(machine_line(info))
    tuner = Tuner(str(model_dir), requests, arrivals, slos, args.objective,
                  fixed={"kv_cache_memory": args.kv_cache_memory}, seed=args.seed,
                  concurrency=args.max_concurrency, clock=budget.clock,
                  warm_up_until=budget.deadline)
    bars = []  # the progress bar, from the first candidate (a refusal comes before)

    def progress(trial: Trial, best: Trial) -> None:
        if not bars:
            bars.append(tqdm(total=int(args.budget_s), unit="s", desc="tuning",
                             dynamic_ncols=True))
        bar = bars[0]
        bar.update(max(0, min(int(budget.elapsed()), bar.total) - bar.n))
        bar.set_postfix_str(f"best {tuner.score(best):.2f} {args.objective}")
        tqdm.write(_row(trial))

    try:
        best = tuner.search(budget, DEFAULTS, progress, REPORT_RESERVE_S)
    finally:
        for bar in bars:
            bar.close()
    front = pareto_front(tuner.trials)
    print(f"{len(tuner.trials)} candidates measured; the defaults first:")
    for t in tuner.trials:
        print(_row(t))
        for note in t.diagnostics:
            print(f"      why: {note}")
    again = tuner.remeasure(budget, DEFAULTS, best, REPORT_RESERVE_S)
    gain, how = gain_vs_defaults(again, tuner.trials[0], best, tuner.score)
    print(f"best vs defaults, {how}: {gain:.2f}x {args.objective}")
    flags = _flags(best.settings)
    if args.tuning_plan:
        tuner.write_plan(best.settings, Path(args.tuning_plan))
        flags["tuning_plan"] = str(Path(args.tuning_plan).resolve())
        print(f"wrote {args.tuning_plan}")
    Path(args.out).write_text(yaml.safe_dump(flags, sort_keys=True))
    print(f"wrote {args.out}")
    if args.plot:
        _plot(args.plot, tuner.trials, front)
        print(f"wrote {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": info, "model": Path(model_dir).name, "workload": args.workload,
            "num_prompts": len(requests), "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
            "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
            "objective": args.objective, "budget_s": args.budget_s,
            "step_cost_s_by_rows": tuner.step_cost, "pruned": tuner.pruned,
            "trials": [asdict(t) for t in tuner.trials],
            "pareto_front": [asdict(t) for t in front], "best": asdict(best),
            "re_measured": again, "gain_vs_defaults": gain, "gain_measured": how,
            "seconds": budget.elapsed()}, indent=1, default=str))
        print(f"wrote {args.json}")
    print(f"took {budget.elapsed():.1f} s of a {args.budget_s:g} s budget")
    return 0

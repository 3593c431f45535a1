"""``kvserve bench memory``: the three KV memory designs x the three batching policies.

Every combination runs the same workload (default ``mixed``) under one fixed KV budget,
on the same engine, model and kernels. Per step the scheduler takes a KV snapshot
(``Scheduler.last_kv_stats``); a run's figures are sums over its steps:

- KV utilisation: slots holding a real token / slots allocated or reserved;
- internal fragmentation: 1 - utilisation (reserved but unused slots);
- external fragmentation: free blocks that cannot serve the next allocation / free blocks
  (buddy: free runs smaller than the run last asked for; contiguous: holes shorter than
  the reservation last asked for; paged: always 0);
- peak and mean running requests, preemptions, moved (copied) blocks;
- recomputed: tokens the model ran beyond the least the workload needs (prompt +
  max_tokens - 1 each), i.e. the cost of preemption by recompute; and steps — both
  machine-independent, unlike the last two:
- useful output tok/s and P99 end-to-end latency (all requests arrive at once, as in
  ``generate``), and useful output tokens per second of this process's CPU time, which
  other jobs on shared cores disturb far less than wall time.

``--dry-run`` schedules the workload through the real scheduler and KV managers without
running the model (sampled tokens are stand-ins): memory figures in seconds for the full
workload; throughput and latency are not measured then.
"""
from __future__ import annotations

import argparse
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvserve.bench.workloads import BenchRequest, Workload

__all__ = ["COMBOS", "MemoryResult", "StepTotals", "parse_kv_budget", "run_combo",
           "format_markdown", "plot_memory", "add_memory_parser", "cmd_memory"]

KV_MANAGERS = ("paged", "buddy", "contiguous")
BATCHINGS = ("continuous", "length-bucket", "static")
COMBOS: tuple[tuple[str, str], ...] = tuple((kv, b) for kv in KV_MANAGERS for b in BATCHINGS)
DEFAULT_BUDGET = "25%"


@dataclass
class StepTotals:
    """Sums of per-step KV snapshots (token- and block-weighted means over steps)."""

    steps: int = 0
    used_tokens: int = 0
    allocated_slots: int = 0
    unusable_free_blocks: int = 0
    free_blocks: int = 0
    running: int = 0
    computed_tokens: int = 0  # tokens the model ran, recomputation after preemption included

    def add(self, stats: Any, num_running: int, num_tokens: int) -> None:
        self.steps += 1
        self.computed_tokens += num_tokens
        self.used_tokens += stats.used_tokens
        self.allocated_slots += stats.allocated_slots
        self.unusable_free_blocks += stats.unusable_free_blocks
        self.free_blocks += stats.num_blocks - stats.num_used_blocks
        self.running += num_running

    @property
    def utilization(self) -> float:
        return self.used_tokens / self.allocated_slots if self.allocated_slots else 1.0

    @property
    def external_fragmentation(self) -> float:
        return self.unusable_free_blocks / self.free_blocks if self.free_blocks else 0.0


@dataclass
class MemoryResult:
    kv_manager: str
    batching: str
    kv_utilization: float
    internal_fragmentation: float
    external_fragmentation: float
    peak_running: int
    preemptions: int
    moved_blocks: int
    recompute_overhead: float  # extra tokens computed / the tokens a run needs at least
    output_tok_s: float | None
    p99_latency_s: float | None
    relative_tok_s: float | None  # output tok/s / the first combination's, same round
    output_tok_per_cpu_s: float | None  # per second of this process's CPU time: steadier
                                        # than wall time when other jobs share the cores
    mean_running: float
    steps: int
    wall_s: float | None
    num_requests: int
    num_blocks: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- the KV budget -------------------------------------------------------------------------


def parse_kv_budget(text: str, workload: Workload, block_size: int,
                    bytes_per_block: int | None = None) -> int:
    """KV blocks for a budget: ``25%`` (of the tokens the whole workload holds at once:
    sum of prompt + max_tokens), ``12800tokens``, ``800blocks``, or a size (``200MiB``,
    bytes; needs ``bytes_per_block``)."""
    from kvserve.config import parse_size

    s = str(text).strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(%|tokens?|tok|blocks?)", s)
    if m:
        value, unit = float(m.group(1)), m.group(2)
        if unit == "%":
            need = sum(r.prompt_len + r.max_tokens for r in workload.requests)
            blocks = int(need * value / 100) // block_size
        elif unit.startswith("tok"):
            blocks = int(value) // block_size
        else:
            blocks = int(value)
    else:
        if bytes_per_block is None:
            raise ValueError(f"kv budget {text!r}: a size needs the model's block size in bytes")
        blocks = parse_size(text) // bytes_per_block
    if blocks < 1:
        raise ValueError(f"kv budget {text!r} is less than one KV block")
    return blocks


# -- one combination -------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def _params(max_tokens: int) -> Any:
    from kvserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run_engine(model_dir: str | Path, requests: Sequence[BenchRequest],
                args: Any) -> tuple[StepTotals, dict[str, Any]]:
    from kvserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(args)
    engine.add_request("warmup", {"prompt_token_ids": list(requests[0].prompt_token_ids[:8])},
                       _params(2))
    while engine.has_unfinished_requests():
        engine.step()
    sched = engine.scheduler
    step_tokens = [0]
    schedule = sched.schedule

    def counting_schedule():  # the bench's own tap on each step's size
        out = schedule()
        step_tokens[0] = out.num_tokens
        return out
    sched.schedule = counting_schedule
    sched.peak_running = 0
    base_preempt, base_moved = sched.num_preemptions, engine.kv.stats().moved_blocks
    totals = StepTotals()
    latencies: list[float] = []
    t0, cpu0 = time.monotonic(), time.process_time()
    for i, r in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": list(r.prompt_token_ids)},
                           _params(r.max_tokens), arrival_time=t0)
    steps = sched.num_steps
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.monotonic()
        if sched.num_steps != steps:
            steps = sched.num_steps
            totals.add(sched.last_kv_stats, sched.num_running, step_tokens[0])
        latencies += [now - t0 for o in outs if o.finished]
    wall = time.monotonic() - t0
    return totals, {"wall_s": wall, "cpu_s": time.process_time() - cpu0,
                    "latencies": latencies,
                    "peak_running": sched.peak_running,
                    "preemptions": sched.num_preemptions - base_preempt,
                    "moved_blocks": engine.kv.stats().moved_blocks - base_moved,
                    "num_blocks": engine.kv.num_blocks}


def _run_dry(requests: Sequence[BenchRequest], args: Any, num_blocks: int
             ) -> tuple[StepTotals, dict[str, Any]]:
    from kvserve.core.kv import create_kv_manager
    from kvserve.core.scheduler import Scheduler
    from kvserve.request import Request

    kv = create_kv_manager(args, num_blocks)
    sched = Scheduler(args, kv)
    t0 = time.monotonic()
    for i, r in enumerate(requests):
        sched.add_request(Request(str(i), list(r.prompt_token_ids), _params(r.max_tokens),
                                  eos_token_id=None, max_tokens=r.max_tokens, arrival_time=t0))
    totals = StepTotals()
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {s.request_id: 0 for s in out.scheduled if s.sample})
        if out.scheduled:  # running counted after the step, as for a real run
            totals.add(sched.last_kv_stats, sched.num_running, out.num_tokens)
    return totals, {"wall_s": None, "cpu_s": None, "latencies": [],
                    "peak_running": sched.peak_running, "preemptions": sched.num_preemptions,
                    "moved_blocks": kv.stats().moved_blocks, "num_blocks": kv.num_blocks}


def run_combo(model_dir: str | Path | None, requests: Sequence[BenchRequest], kv_manager: str,
              batching: str, num_blocks: int, engine_args: dict[str, Any] | None = None,
              dry_run: bool = False) -> MemoryResult:
    """Run the requests under one kv_manager x batching combination."""
    from kvserve.config import EngineArgs

    args = EngineArgs(model=None if model_dir is None else str(model_dir),
                      **{**(engine_args or {}), "kv_manager": kv_manager, "batching": batching,
                         "num_kv_blocks": num_blocks})
    if dry_run:
        totals, info = _run_dry(requests, args, num_blocks)
    else:
        totals, info = _run_engine(model_dir, requests, args)
    wall = info["wall_s"]
    useful = sum(r.max_tokens for r in requests)
    least = sum(r.prompt_len + r.max_tokens - 1 for r in requests)  # last token is not fed
    return MemoryResult(
        kv_manager=kv_manager, batching=batching,
        kv_utilization=totals.utilization,
        internal_fragmentation=1.0 - totals.utilization,
        external_fragmentation=totals.external_fragmentation,
        peak_running=info["peak_running"], preemptions=info["preemptions"],
        moved_blocks=info["moved_blocks"],
        recompute_overhead=totals.computed_tokens / least - 1.0 if least else 0.0,
        output_tok_s=useful / wall if wall else None,
        p99_latency_s=_percentile(info["latencies"], 99), relative_tok_s=None,
        output_tok_per_cpu_s=useful / info["cpu_s"] if info["cpu_s"] else None,
        mean_running=totals.running / totals.steps if totals.steps else 0.0,
        steps=totals.steps, wall_s=wall, num_requests=len(requests),
        num_blocks=info["num_blocks"])


# -- reporting ---------------------------------------------------------------------------------


def combine_rounds(rounds: Sequence[Sequence[MemoryResult]]) -> list[MemoryResult]:
    """One result per combination over repeated rounds (each round runs every combination
    once, in the same order): memory figures of the first round, medians of throughput,
    latency and of throughput relative to the round's first combination."""
    import statistics

    out = []
    for j, first in enumerate(rounds[0]):
        runs = [r[j] for r in rounds if len(r) > j]
        toks = [r.output_tok_s for r in runs if r.output_tok_s]
        p99s = [r.p99_latency_s for r in runs if r.p99_latency_s is not None]
        cpus = [r.output_tok_per_cpu_s for r in runs if r.output_tok_per_cpu_s]
        rel = [r[j].output_tok_s / r[0].output_tok_s for r in rounds
               if len(r) > j and r[j].output_tok_s and r[0].output_tok_s]
        out.append(MemoryResult(**{
            **first.to_dict(),
            "output_tok_s": statistics.median(toks) if toks else None,
            "p99_latency_s": statistics.median(p99s) if p99s else None,
            "relative_tok_s": statistics.median(rel) if rel else None,
            "output_tok_per_cpu_s": statistics.median(cpus) if cpus else None,
            "extra": {**first.extra, "rounds": len(runs),
                      "output_tok_s_runs": [r.output_tok_s for r in runs],
                      "p99_latency_s_runs": [r.p99_latency_s for r in runs]}}))
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def format_markdown(results: Sequence[MemoryResult], context: str = "") -> str:
    """The seeds' "key metrics comparison", filled in with measured numbers."""
    head = ("| kv-manager | batching | KV utilisation | internal frag. | external frag. "
            "| peak running | mean running | preemptions | moved blocks | recomputed "
            "| steps | output tok/s | tok/s ratio | tok per CPU-s | P99 latency s |")
    lines = [head, "|" + "---|" * 15]
    for r in results:
        lines.append(
            f"| {r.kv_manager} | {r.batching} | {_pct(r.kv_utilization)} "
            f"| {_pct(r.internal_fragmentation)} | {_pct(r.external_fragmentation)} "
            f"| {r.peak_running} | {r.mean_running:.1f} | {r.preemptions} | {r.moved_blocks} "
            f"| {_pct(r.recompute_overhead)} | {r.steps} "
            f"| {_num(r.output_tok_s, '.1f')} | {_num(r.relative_tok_s, '.2f')} "
            f"| {_num(r.output_tok_per_cpu_s, '.1f')} | {_num(r.p99_latency_s, '.1f')} |")
    out = "\n".join(lines)
    summary = ordering_summary(results)
    return (context + "\n\n" if context else "") + out + ("\n\n" + summary if summary else "")


def ordering_summary(results: Sequence[MemoryResult]) -> str:
    """One line per claim: the measured ordering of the designs."""
    def by(key, batching="continuous", kvs=KV_MANAGERS):
        rows = {r.kv_manager: r for r in results if r.batching == batching and r.kv_manager in kvs}
        return sorted(rows.values(), key=key, reverse=True)

    lines = []
    util = by(lambda r: r.kv_utilization)
    if util:
        lines.append("KV utilisation (continuous): " + " > ".join(
            f"{r.kv_manager} {_pct(r.kv_utilization)}" for r in util))
    paged = [r for r in results if r.kv_manager == "paged"]
    if paged:
        worst = min(r.kv_utilization for r in paged)
        lines.append(f"paged KV utilisation, lowest over batching policies: {_pct(worst)} "
                     f"({'meets' if worst >= 0.98 else 'misses'} the 98 % target)")
    conc = by(lambda r: r.mean_running)
    if conc:
        lines.append("mean running requests (continuous): " + " > ".join(
            f"{r.kv_manager} {r.mean_running:.1f}" for r in conc))
    timed = [r for r in results if r.relative_tok_s]
    for kv in KV_MANAGERS:
        rows = sorted((r for r in timed if r.kv_manager == kv),
                      key=lambda r: r.relative_tok_s, reverse=True)
        if rows:
            lines.append(f"output tok/s ratio ({kv}): " + " > ".join(
                f"{r.batching} {r.relative_tok_s:.2f}" for r in rows))
    return "\n".join(f"- {line}" for line in lines)


def plot_memory(path: str | Path, results: Sequence[MemoryResult], subtitle: str = "") -> Path:
    """Four panels: utilisation and fragmentation, throughput, P99 latency, concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = {"length-bucket": "len-bucket"}
    labels = [f"{r.kv_manager}\n{short.get(r.batching, r.batching)}" for r in results]
    xs = list(range(len(results)))
    fig, axes = plt.subplots(2, 2, figsize=(max(11.0, 1.7 * len(results)), 9.0))

    def bars(ax, series: dict[str, list[float]], title: str, ylabel: str, fmt: str) -> None:
        if not any(v for values in series.values() for v in values):
            ax.text(0.5, 0.5, "not measured (dry run)", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_title(title, fontsize=10)
            ax.set_xticks([])
            ax.set_yticks([])
            return
        n = len(series)
        width = 0.8 / n
        for i, (name, values) in enumerate(series.items()):
            pos = [x + (i - (n - 1) / 2) * width for x in xs]
            b = ax.bar(pos, values, width, label=name)
            ax.bar_label(b, labels=[format(v, fmt) for v in values], fontsize=6, padding=1)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
        if n > 1:
            ax.legend(fontsize=7)

    bars(axes[0][0], {"KV utilisation": [100 * r.kv_utilization for r in results],
                      "internal frag.": [100 * r.internal_fragmentation for r in results],
                      "external frag.": [100 * r.external_fragmentation for r in results]},
         "KV memory (share of slots / free blocks)", "%", ".0f")
    bars(axes[0][1], {"per wall second": [r.output_tok_s or 0.0 for r in results],
                      "per CPU second": [r.output_tok_per_cpu_s or 0.0 for r in results]},
         "useful output tokens / s", "tok/s", ".0f")
    bars(axes[1][0], {"P99 latency": [r.p99_latency_s or 0.0 for r in results]},
         "P99 end-to-end latency", "s", ".1f")
    bars(axes[1][1], {"peak running": [float(r.peak_running) for r in results],
                      "mean running": [r.mean_running for r in results],
                      "preemptions": [float(r.preemptions) for r in results]},
         "concurrency and preemptions", "requests", ".0f")
    fig.suptitle("kvserve bench memory" + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


# -- the command ---------------------------------------------------------------------------------


def add_memory_parser(sub: Any) -> None:
    """Register ``kvserve bench memory`` on the bench sub-parsers."""
    from kvserve.bench.bench_args import add_engine_args, add_output_args, add_workload_args

    p = sub.add_parser(
        "memory", help="paged / buddy / contiguous KV x continuous / length-bucket / static",
        description="Run the workload under one fixed KV budget for every kv-manager x "
                    "batching combination; report utilisation, fragmentation, concurrency, "
                    "preemptions, throughput and P99 latency (JSON, PNG, markdown).")
    p.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    p.add_argument("--kv-budget", default=DEFAULT_BUDGET,
                   help="KV budget for every combination: N%% of the tokens the whole "
                        "workload holds at once, Ntokens, Nblocks, or a size like 200MiB "
                        f"(default {DEFAULT_BUDGET.replace('%', '%%')})")
    p.add_argument("--kv-managers", default=",".join(KV_MANAGERS), help="comma list")
    p.add_argument("--batchings", default=",".join(BATCHINGS), help="comma list")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over all combinations (interleaved, so drifting load hits "
                        "all alike); throughput and latency are medians (default 1)")
    p.add_argument("--dry-run", action="store_true",
                   help="scheduler and KV managers only, no model: memory figures, no timing")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="write the markdown table (default: next to --json, .md)")
    add_workload_args(p)
    add_engine_args(p)
    add_output_args(p)
    p.set_defaults(func=cmd_memory)


def cmd_memory(args: argparse.Namespace) -> int:
    from kvserve.bench import report
    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir, workload_from_args

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
        num_blocks = parse_kv_budget(args.kv_budget, wl, block_size, bytes_per_block)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    combos = [(kv, b) for kv in _names(args.kv_managers, KV_MANAGERS)
              for b in _names(args.batchings, BATCHINGS)]
    need = sum(r.prompt_len + r.max_tokens for r in wl.requests)
    settings = {"model": str(model_dir), "workload": wl.name, "requests": len(wl),
                "prompt_tokens": wl.num_prompt_tokens, "output_tokens": wl.num_output_tokens,
                "kv_budget": f"{args.kv_budget} = {num_blocks} blocks x {block_size} = "
                             f"{num_blocks * block_size} tokens "
                             f"({num_blocks * block_size / need:.0%} of the {need} the "
                             "workload holds at once)",
                "engine_args": engine_args, "dry_run": args.dry_run}
    report.print_settings("kvserve bench memory", settings)
    info = report.machine_info()
    print(report.machine_line(info))
    rounds: list[list[MemoryResult]] = []
    for i in range(1 if args.dry_run else args.repeats):
        if args.repeats > 1 and not args.dry_run:
            print(f"round {i + 1} of {args.repeats}", flush=True)
        done: dict[tuple[str, str], MemoryResult] = {}
        for kv, b in combos if i % 2 == 0 else combos[::-1]:  # alternate: drift cancels
            res = run_combo(model_dir, wl.requests, kv, b, num_blocks, engine_args,
                            args.dry_run)
            done[kv, b] = res
            print(f"  {kv:10s} {b:13s} util {_pct(res.kv_utilization):>7s}  "
                  f"ext {_pct(res.external_fragmentation):>7s}  peak {res.peak_running:3d}  "
                  f"preempt {res.preemptions:4d}  moved {res.moved_blocks:5d}  "
                  f"recomputed {_pct(res.recompute_overhead):>7s}  steps {res.steps:5d}  "
                  f"tok/s {_num(res.output_tok_s, '.1f')}  "
                  f"tok/CPU-s {_num(res.output_tok_per_cpu_s, '.1f')}  "
                  f"p99 {_num(res.p99_latency_s, '.1f')} s", flush=True)
        rounds.append([done[c] for c in combos])
        # write after every round: a long run keeps what it measured
        _write_outputs(args, info, model_dir, wl, settings, num_blocks, block_size, rounds,
                       final=i + 1 == (1 if args.dry_run else args.repeats))
    return 0


def _write_outputs(args: argparse.Namespace, info: dict[str, Any], model_dir: Path,
                   wl: Workload, settings: dict[str, Any], num_blocks: int, block_size: int,
                   rounds: list[list[MemoryResult]], final: bool) -> None:
    from kvserve.bench import report

    results = combine_rounds(rounds)
    first = f"{results[0].kv_manager}/{results[0].batching}" if results else "-"
    context = (f"Workload `{wl.name}`, {len(wl)} requests, KV budget {num_blocks} blocks x "
               f"{block_size} tokens"
               + (", dry run (no model: memory figures only)" if args.dry_run else
                  f", {len(rounds)} round(s): medians; tok/s ratio is to {first} in the "
                  "same round")
               + f";\n{report.machine_line(info)}")
    md = format_markdown(results, context)
    if final:
        print(md)
    out = {"machine": info, "model": str(model_dir), "workload": wl.describe(),
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
        say(f"wrote {plot_memory(args.plot, results, context)}")


def _names(text: str, allowed: tuple[str, ...]) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(f"choose from {', '.join(allowed)}; got {text!r}")
    return names


def _bytes_per_block(model_dir: Path, block_size: int, dtype: str) -> int | None:
    try:
        from kvserve.model.config import ModelConfig
        from kvserve.model.loader import resolve_dtype
        from kvserve.worker.model_runner import kv_bytes_per_block

        cfg = ModelConfig.from_dir(model_dir)
        return kv_bytes_per_block(cfg, block_size, resolve_dtype(dtype, cfg))
    except Exception:  # only needed for a size budget; parse_kv_budget says so if missing
        return None

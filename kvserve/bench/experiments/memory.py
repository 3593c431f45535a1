"""``kvserve bench memory``: the three KV memory designs x the three batching policies.

Every combination runs the same workload (default ``mixed``) under one fixed KV budget,
on the same engine, model and kernels. Each step's scheduler output carries a
:class:`~kvserve.core.scheduler_output.SchedulerStats` with a KV snapshot; a run's
figures are sums over its steps:

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
workload; throughput and latency are not measured then. The command itself is in
``commands.py``, its plot in ``plots.py``.
"""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvserve.bench.instruments.paired import PairedRatio, paired_ratio
from kvserve.bench.workloads.definitions import BenchRequest, Workload
from kvserve.core.batching import BATCHING_POLICIES
from kvserve.core.kv import KV_MANAGERS

__all__ = ["combos", "DEFAULT_BUDGET", "MemoryResult", "kv_designs",
           "StepTotals", "parse_kv_budget", "run_combo", "combine_rounds", "format_markdown",
           "ordering_summary"]

def combos() -> tuple[tuple[str, str], ...]:
    """Every registered KV manager x every registered batching policy."""
    return tuple((kv, b) for kv in KV_MANAGERS.names() for b in BATCHING_POLICIES.names())

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
    blocks_per_running: float = 0.0  # sum over steps of used blocks / running requests

    peak_running: int = 0

    def add(self, stats: Any, num_running: int, num_tokens: int) -> None:
        """One step: its SchedulerStats, the requests running after it, its tokens."""
        kv = stats.kv
        self.steps += 1
        self.computed_tokens += num_tokens
        self.used_tokens += kv.used_tokens
        self.allocated_slots += kv.allocated_slots
        self.unusable_free_blocks += kv.unusable_free_blocks
        self.free_blocks += kv.num_blocks - kv.num_used_blocks
        self.running += num_running
        self.blocks_per_running += kv.num_used_blocks / max(stats.num_running, 1)
        self.peak_running = max(self.peak_running, stats.num_running)

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
    # output tok/s over the first combination's in the same round: the median of the
    # rounds' ratios (kvserve.bench.instruments.paired)
    relative_tok_s: PairedRatio | None
    output_tok_per_cpu_s: float | None  # per second of this process's CPU time: steadier
                                        # than wall time when other jobs share the cores
    mean_running: float
    steps: int
    wall_s: float | None
    num_requests: int
    num_blocks: int
    extra: dict[str, Any] = field(default_factory=dict)
    # mean over steps of the KV the pool holds per running request (bytes of a block
    # known: the design's blocks may hold fewer layers, see core/kv/groups.py)
    kv_mib_per_request: float | None = None

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
                args: Any, progress: bool = False) -> tuple[StepTotals, dict[str, Any]]:
    from tqdm.auto import tqdm

    from kvserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(args)
    engine.add_request("warmup", {"prompt_token_ids": list(requests[0].prompt_token_ids[:8])},
                       _params(2))
    while engine.has_unfinished_requests():
        engine.step()
    base = engine.get_stats().scheduler
    totals = StepTotals()
    latencies: list[float] = []
    t0, cpu0 = time.monotonic(), time.process_time()
    for i, r in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": list(r.prompt_token_ids)},
                           _params(r.max_tokens), arrival_time=t0)
    bar = tqdm(total=len(requests), desc=f"{args.kv_manager}/{args.batching}", leave=False,
               disable=not progress, dynamic_ncols=True)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.monotonic()
        step = engine.last_step_stats
        if step is not None:  # running counted after the step
            totals.add(step, engine.scheduler.num_running, step.num_scheduled_tokens)
        done = [now - t0 for o in outs if o.finished]
        latencies += done
        if done:
            bar.update(len(done))
    wall = time.monotonic() - t0
    bar.close()
    end = engine.get_stats().scheduler
    engine.close()
    return totals, {"wall_s": wall, "cpu_s": time.process_time() - cpu0,
                    "latencies": latencies, "peak_running": totals.peak_running,
                    "preemptions": end.num_preemptions - base.num_preemptions,
                    "moved_blocks": end.kv.moved_blocks - base.kv.moved_blocks,
                    "num_blocks": end.kv.num_blocks}


def _run_dry(requests: Sequence[BenchRequest], args: Any, num_blocks: int
             ) -> tuple[StepTotals, dict[str, Any]]:
    from kvserve.core.kv import create_kv_manager
    from kvserve.core.scheduler import Scheduler
    from kvserve.request import Request

    from kvserve.core.kv.groups import engine_kv_groups

    groups = engine_kv_groups(args.create_engine_config()) if args.model else None
    kv = create_kv_manager(args.create_cache_config(), num_blocks, groups=groups,
                           step_tokens=args.max_num_batched_tokens)
    sched = Scheduler(args.create_scheduler_config(), kv)
    t0 = time.monotonic()
    for i, r in enumerate(requests):
        sched.add_request(Request(str(i), list(r.prompt_token_ids), _params(r.max_tokens),
                                  eos_token_id=None, max_tokens=r.max_tokens, arrival_time=t0))
    totals = StepTotals()
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {s.request_id: 0 for s in out.scheduled if s.sample})
        if out.scheduled:  # running counted after the step, as for a real run
            totals.add(out.stats, sched.num_running, out.num_tokens)
    stats = kv.stats()
    return totals, {"wall_s": None, "cpu_s": None, "latencies": [],
                    "peak_running": totals.peak_running, "preemptions": sched.num_preemptions,
                    "moved_blocks": stats.moved_blocks, "num_blocks": stats.num_blocks}


def kv_designs(model_dir: Path, managers: list[str], num_blocks: int
                ) -> dict[str, tuple[str, dict[str, Any], int]]:
    """label -> (kv_manager, engine settings, blocks) for each design compared. A model
    mixing windowed and full layers runs paged memory twice, in the same bytes: keeping
    every layer's KV (``paged-no-hybrid``), and with a table per KV group (``paged``,
    the default), whose blocks hold one group's layers."""
    from kvserve.core.kv.groups import kv_groups
    from kvserve.model.registry import read_arch_config

    arch = read_arch_config(model_dir)
    groups = kv_groups(arch.layer_windows, arch.sliding_window)
    keep_all = {"disable_hybrid_kv_cache_manager": True}
    designs = {}
    for kv in managers:
        if kv == "paged" and groups is not None:
            designs["paged-no-hybrid"] = ("paged", keep_all, num_blocks)
            designs["paged"] = ("paged", {}, num_blocks * arch.num_layers // groups.slots)
        else:
            designs[kv] = (kv, keep_all if groups is not None else {}, num_blocks)
    return designs


def run_combo(model_dir: str | Path | None, requests: Sequence[BenchRequest], kv_manager: str,
              batching: str, num_blocks: int, engine_args: dict[str, Any] | None = None,
              dry_run: bool = False, progress: bool = False, label: str | None = None,
              bytes_per_block: int | None = None) -> MemoryResult:
    """Run the requests under one kv_manager x batching combination (``progress``: a
    bar of the requests done while the model runs; ``label``: the design's name in the
    results, when not the manager's)."""
    from kvserve.engine.engine_args import EngineArgs

    args = EngineArgs(model=None if model_dir is None else str(model_dir),
                      **{**(engine_args or {}), "kv_manager": kv_manager, "batching": batching,
                         "num_kv_blocks": num_blocks})
    if dry_run:
        totals, info = _run_dry(requests, args, num_blocks)
    else:
        totals, info = _run_engine(model_dir, requests, args, progress)
    wall = info["wall_s"]
    useful = sum(r.max_tokens for r in requests)
    least = sum(r.prompt_len + r.max_tokens - 1 for r in requests)  # last token is not fed
    return MemoryResult(
        kv_manager=label or kv_manager, batching=batching,
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
        num_blocks=info["num_blocks"],
        kv_mib_per_request=(totals.blocks_per_running / totals.steps * bytes_per_block / 2**20
                            if bytes_per_block and totals.steps else None))


# -- reporting ---------------------------------------------------------------------------------


def combine_rounds(rounds: Sequence[Sequence[MemoryResult]]) -> list[MemoryResult]:
    """One result per combination over repeated rounds (each round runs every combination
    once, in the same order): memory figures of the first round, medians of throughput
    and latency, and throughput over the round's first combination's, paired by round."""
    import statistics

    out = []
    for j, first in enumerate(rounds[0]):
        runs = [r[j] for r in rounds if len(r) > j]
        toks = [r.output_tok_s for r in runs if r.output_tok_s]
        p99s = [r.p99_latency_s for r in runs if r.p99_latency_s is not None]
        cpus = [r.output_tok_per_cpu_s for r in runs if r.output_tok_per_cpu_s]
        with_j = [r for r in rounds if len(r) > j]
        out.append(MemoryResult(**{
            **first.to_dict(),
            "output_tok_s": statistics.median(toks) if toks else None,
            "p99_latency_s": statistics.median(p99s) if p99s else None,
            "relative_tok_s": paired_ratio([r[j].output_tok_s for r in with_j],
                                           [r[0].output_tok_s for r in with_j]),
            "output_tok_per_cpu_s": statistics.median(cpus) if cpus else None,
            "extra": {**first.extra, "rounds": len(runs),
                      "output_tok_s_runs": [r.output_tok_s for r in runs],
                      "p99_latency_s_runs": [r.p99_latency_s for r in runs]}}))
    return out


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def num_or_dash(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def format_markdown(results: Sequence[MemoryResult], context: str = "") -> str:
    """The seeds' "key metrics comparison", filled in with measured numbers."""
    head = ("| kv-manager | batching | KV utilisation | internal frag. | external frag. "
            "| peak running | mean running | preemptions | moved blocks | recomputed "
            "| steps | output tok/s | tok/s ratio | tok per CPU-s | P99 latency s |")
    per_request = any(r.kv_mib_per_request is not None for r in results)
    if per_request:
        head += " KV MiB / request |"
    lines = [head, "|" + "---|" * (16 if per_request else 15)]
    for r in results:
        lines.append(
            f"| {r.kv_manager} | {r.batching} | {pct(r.kv_utilization)} "
            f"| {pct(r.internal_fragmentation)} | {pct(r.external_fragmentation)} "
            f"| {r.peak_running} | {r.mean_running:.1f} | {r.preemptions} | {r.moved_blocks} "
            f"| {pct(r.recompute_overhead)} | {r.steps} "
            f"| {num_or_dash(r.output_tok_s, '.1f')} "
            f"| {'–' if r.relative_tok_s is None else r.relative_tok_s.cell()} "
            f"| {num_or_dash(r.output_tok_per_cpu_s, '.1f')} "
            f"| {num_or_dash(r.p99_latency_s, '.1f')} |"
            + (f" {num_or_dash(r.kv_mib_per_request, '.1f')} |" if per_request else ""))
    out = "\n".join(lines)
    summary = ordering_summary(results)
    return (context + "\n\n" if context else "") + out + ("\n\n" + summary if summary else "")


def ordering_summary(results: Sequence[MemoryResult]) -> str:
    """One line per claim: the measured ordering of the designs."""
    def by(key, batching="continuous", kvs=KV_MANAGERS.names()):
        rows = {r.kv_manager: r for r in results if r.batching == batching and r.kv_manager in kvs}
        return sorted(rows.values(), key=key, reverse=True)

    lines = []
    util = by(lambda r: r.kv_utilization)
    if util:
        lines.append("KV utilisation (continuous): " + " > ".join(
            f"{r.kv_manager} {pct(r.kv_utilization)}" for r in util))
    paged = [r for r in results if r.kv_manager == "paged"]
    if paged:
        worst = min(r.kv_utilization for r in paged)
        lines.append(f"paged KV utilisation, lowest over batching policies: {pct(worst)} "
                     f"({'meets' if worst >= 0.98 else 'misses'} the 98 % target)")
    conc = by(lambda r: r.mean_running)
    if conc:
        lines.append("mean running requests (continuous): " + " > ".join(
            f"{r.kv_manager} {r.mean_running:.1f}" for r in conc))
    timed = [r for r in results if r.relative_tok_s is not None]
    for kv in KV_MANAGERS.names():
        rows = sorted((r for r in timed if r.kv_manager == kv),
                      key=lambda r: r.relative_tok_s.median, reverse=True)
        if rows:
            lines.append(f"output tok/s ratio ({kv}): " + " > ".join(
                f"{r.batching} {r.relative_tok_s.cell()}" for r in rows))
    return "\n".join(f"- {line}" for line in lines)

"""The search: which settings, how they are pruned, how candidates are measured.

The model is loaded once; each candidate is a fresh engine (scheduler, KV manager, KV
pool) over the same weights, replaying the workload on a simulated clock
(:mod:`kvserve.tune.replay`). Before searching, the step cost is measured by row count;
settings it shows cannot meet the SLOs are pruned from the space (a decode batch of
``max_num_seqs`` rows slower than the TPOT SLO, a prompt chunk of
``max_num_batched_tokens`` slower than the TTFT SLO). The rest is searched with
optuna's TPE sampler (seeded) for as long as the budget leaves room for the final
re-measurement and the report (:mod:`kvserve.tune.budget`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kvserve.bench.workloads.definitions import BenchRequest
from kvserve.tune.budget import (FINAL_MARGIN, FINAL_ROUNDS, REPORT_RESERVE_S, Budget,
                                 longest_candidate_s, refuse_if_too_small)
from kvserve.tune.replay import ReplayResult, replay

SPACE: dict[str, list] = {
    "max_num_seqs": [8, 16, 32, 64, 128, 256],
    "max_num_batched_tokens": [256, 512, 1024, 2048, 4096],
    "block_size": [8, 16, 32],
    "kv_manager": ["paged", "buddy", "contiguous"],
    "batching": ["continuous", "length-bucket", "static"],
    "bucket_window_s": [0.02, 0.1, 0.5],          # length-bucket only
    "max_batch_size": [8, 16, 32],                # length-bucket and static
    "prefill_join_tokens": [0, 128, 256, 512],
    "kv_cache_dtype": ["auto", "bfloat16"],
    "enable_prefix_caching": [True, False],       # paged only
    "num_speculative_tokens": [0, 2, 4],          # n-gram speculation; 0: off
}
ROW_COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@dataclass
class Slos:
    ttft_s: float
    tpot_s: float


@dataclass
class Trial:
    settings: dict
    throughput: float = 0.0       # output tokens / s
    goodput: float = 0.0          # requests / s meeting both SLOs
    p99_ttft_ms: float = 0.0
    p99_tpot_ms: float = 0.0
    seconds: float = 0.0          # real time the candidate took
    diagnostics: list[str] = field(default_factory=list)
    error: str | None = None


def _p99(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else (
        values[0] if values else 0.0)


def engine_args_of(settings: dict) -> dict:
    """EngineArgs keywords of a candidate (the speculation count becomes its config)."""
    args = {k: v for k, v in settings.items() if k != "num_speculative_tokens"}
    k = settings.get("num_speculative_tokens", 0)
    if k:
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k}
    if args.get("kv_manager", "paged") != "paged":
        args["enable_prefix_caching"] = False
    return args


def diagnose(result: ReplayResult, settings: dict, kv_bytes: int, free_bytes: int) -> list[str]:
    """Why a configuration is slow, in the terms of the tuning guide."""
    notes = []
    if result.preemptions:
        notes.append(f"KV pool too small: {result.preemptions} preemptions; give it more "
                     "memory (kv_cache_memory) or lower max_num_seqs")
    if result.steps and result.starved_steps / result.steps > 0.2:
        notes.append(f"the step token budget (max_num_batched_tokens="
                     f"{settings.get('max_num_batched_tokens')}) left running requests out "
                     f"of {100 * result.starved_steps / result.steps:.0f}% of steps")
    if settings.get("batching") == "length-bucket" and result.ttft_s and \
            _p99(result.ttft_s) > 2 * settings.get("bucket_window_s", 0.1):
        notes.append("too many length buckets for the request-length spread: requests wait "
                     "for their bucket to fill; widen bucket_window_s or use continuous")
    if settings.get("kv_cache_dtype") == "bfloat16":
        notes.append("kv_cache_dtype bfloat16 rounds every cached key and value: outputs are "
                     "no longer bit-exact with float32")
    if free_bytes and kv_bytes > 0.75 * (kv_bytes + free_bytes):
        notes.append("memory headroom under 25 %: the KV pool leaves too little for weights "
                     "and activations")
    return notes


class Tuner:
    def __init__(self, model_dir: str, requests: Sequence[BenchRequest],
                 arrivals: Sequence[float], slos: Slos, objective: str = "goodput",
                 fixed: dict | None = None, space: dict | None = None, seed: int = 0,
                 log: Callable[[str], None] = print, concurrency: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 warm_up_until: float = float("inf")) -> None:
        """``arrivals`` None: a closed loop of ``concurrency`` requests in flight;
        ``clock``: what budgets are read on; the first replay (which warms the kernels
        and shows what a replay takes) stops when ``clock()`` reaches ``warm_up_until``."""
        from kvserve.engine.engine_args import EngineArgs
        from kvserve.engine.llm_engine import LLMEngine

        self.model_dir, self.requests, self.arrivals = model_dir, requests, arrivals
        self.concurrency = concurrency
        self.slos, self.objective, self.seed, self.log = slos, objective, seed, log
        self.clock = clock
        self.fixed = dict(fixed or {})
        self.space = {k: list(v) for k, v in (space or SPACE).items()}
        if "num_threads" not in self.space:
            from kvserve.worker.platform import physical_cores
            cores = physical_cores()
            self.space["num_threads"] = sorted({1, max(1, cores // 2), cores})
        self.trials: list[Trial] = []
        first = LLMEngine(EngineArgs(model=model_dir, **self.fixed))
        self.model = first.worker.model
        self.step_cost = first.worker.time_step_rows(ROW_COUNTS)
        self.pruned = self._prune()
        # warm: oneDNN makes each new GEMM shape once; and a first measure of a replay
        started = clock()
        warm = replay(first, requests, arrivals, max(0.0, warm_up_until - started),
                      concurrency)
        self.first_replay_s = clock() - started
        self.first_replay_complete = warm.complete  # False: cut, it takes longer
        first.close()

    # -- pruning -------------------------------------------------------------------------

    def _cost(self, rows: int) -> float:
        known = sorted(self.step_cost.items())
        below = [(r, t) for r, t in known if r <= rows]
        r0, t0 = below[-1] if below else known[0]
        if r0 == rows or len(known) < 2:
            return t0
        (ra, ta), (rb, tb) = known[-2], known[-1]
        return t0 + (rows - r0) * max(0.0, (tb - ta) / (rb - ra))

    def _prune(self) -> dict[str, list]:
        pruned = {}
        for key, slo, name in (("max_num_seqs", self.slos.tpot_s, "TPOT"),
                               ("max_num_batched_tokens", self.slos.ttft_s, "TTFT")):
            keep = [v for v in self.space[key] if self._cost(v) <= slo]
            gone = [v for v in self.space[key] if v not in keep]
            if gone:
                pruned[key] = gone
                self.log(f"pruned {key} {gone}: one step of that many rows is slower than "
                         f"the {name} SLO")
            self.space[key] = keep or self.space[key][:1]
        return pruned

    # -- measuring -----------------------------------------------------------------------

    def measure(self, settings: dict, until: float = float("inf")) -> Trial:
        """Build and replay a candidate; its replay is cut when ``clock()`` reaches
        ``until`` (the candidate then fails)."""
        from kvserve.engine.engine_args import EngineArgs
        from kvserve.engine.llm_engine import LLMEngine
        from kvserve.worker.platform import available_memory_bytes

        trial = Trial(settings)
        start = self.clock()
        try:
            args = EngineArgs(model=self.model_dir, **{**self.fixed, **engine_args_of(settings)})
            engine = LLMEngine(args, model=self.model)
        except (ValueError, RuntimeError) as e:
            trial.error = str(e)
            trial.seconds = self.clock() - start
            return trial
        try:
            result = replay(engine, self.requests, self.arrivals,
                            max(0.0, until - self.clock()), self.concurrency)
            kv_bytes = engine.kv_layout.num_blocks * engine.kv_layout.bytes_per_block
            trial.diagnostics = diagnose(result, settings, kv_bytes, available_memory_bytes())
        finally:
            engine.close()
        trial.seconds = self.clock() - start
        if not result.complete:
            trial.error = "the budget ran out during this candidate's replay"
            return trial
        if not result.ttft_s or result.duration_s <= 0:
            trial.error = "no request finished"
            return trial
        met = sum(1 for ttft, tpot in zip(result.ttft_s, result.tpot_s)
                  if ttft <= self.slos.ttft_s and tpot <= self.slos.tpot_s)
        trial.throughput = result.output_tokens / result.duration_s
        trial.goodput = met / result.duration_s
        trial.p99_ttft_ms = 1e3 * _p99(result.ttft_s)
        trial.p99_tpot_ms = 1e3 * _p99(result.tpot_s)
        return trial

    def score(self, trial: Trial) -> float:
        if trial.error:
            return float("-inf")
        return trial.goodput if self.objective == "goodput" else trial.throughput

    # -- searching -----------------------------------------------------------------------

    def write_plan(self, settings: dict, path: Path) -> None:
        """Write the tuning plan of an engine of ``settings`` to ``path`` (replacing
        what is there): the plan its candidate's start-up cached, else measured now."""
        from kvserve.engine.engine_args import EngineArgs
        from kvserve.engine.llm_engine import LLMEngine

        path.unlink(missing_ok=True)
        args = EngineArgs(model=self.model_dir, tuning_plan=str(path),
                          **{**self.fixed, **engine_args_of(settings)})
        LLMEngine(args, model=self.model).close()

    def search(self, budget: Budget, defaults: dict, progress=None,
               report_s: float = REPORT_RESERVE_S) -> Trial:
        """Measure the defaults, then candidates while the budget leaves room for one more
        and the end (:mod:`kvserve.tune.budget`); the best. Raises BudgetTooSmall, before
        any candidate, when the budget cannot hold the defaults, one candidate and the
        end."""
        try:
            import optuna
        except ImportError as e:
            raise ValueError("kvserve tune searches with optuna: pip install "
                             "'kvserve[tune]'") from e
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        refuse_if_too_small(budget, budget.elapsed(), self.first_replay_s, report_s,
                            defaults_measured=False,
                            candidate_known=self.first_replay_complete)
        first = self.measure(defaults, budget.deadline - report_s)
        self.trials.append(first)
        if first.error:
            if first.error.startswith("the budget ran out"):  # cut: a lower bound
                refuse_if_too_small(budget, budget.elapsed(), first.seconds, report_s,
                                    defaults_measured=True, candidate_known=False)
            raise ValueError(f"the defaults do not run: {first.error}")
        refuse_if_too_small(budget, budget.elapsed(), first.seconds, report_s,
                            defaults_measured=True)
        best = first
        study = optuna.create_study(direction="maximize",
                                    sampler=optuna.samplers.TPESampler(seed=self.seed))

        def objective(t: optuna.Trial) -> float:
            nonlocal best
            settings = self._suggest(t)
            longest = longest_candidate_s(budget, first.seconds, best.seconds, report_s)
            trial = self.measure(settings, self.clock() + longest)
            self.trials.append(trial)
            if self.score(trial) > self.score(best):
                best = trial
            if progress is not None:
                progress(trial, best)
            return self.score(trial) if not trial.error else -1.0

        while self._typical_candidate_s() <= longest_candidate_s(
                budget, first.seconds, best.seconds, report_s):
            study.optimize(objective, n_trials=1)
        return best

    def remeasure(self, budget: Budget, defaults: dict, best: Trial,
                  report_s: float = REPORT_RESERVE_S) -> dict[str, list[float]]:
        """The defaults and the best measured again, alternately, FINAL_ROUNDS times
        each; their scores by name. A measurement starts only if it can end before the
        report's reserve at what it took before (with FINAL_MARGIN), and is cut there."""
        settings = {"defaults": defaults, "best": best.settings}
        took = {"defaults": self.trials[0].seconds, "best": best.seconds}
        again: dict[str, list[float]] = {"defaults": [], "best": []}
        for i in range(FINAL_ROUNDS):
            for name in ("defaults", "best") if i % 2 == 0 else ("best", "defaults"):
                if budget.left() - report_s < FINAL_MARGIN * took[name]:
                    continue
                trial = self.measure(settings[name], budget.deadline - report_s)
                if not trial.error:
                    again[name].append(self.score(trial))
        return again

    def _typical_candidate_s(self) -> float:
        """What a candidate takes: the median of those measured to the end."""
        done = [t.seconds for t in self.trials if not t.error]
        return statistics.median(done) if done else self.first_replay_s

    def _suggest(self, t) -> dict:
        s = {k: t.suggest_categorical(k, self.space[k]) for k in (
            "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_manager", "batching",
            "prefill_join_tokens", "kv_cache_dtype", "num_speculative_tokens", "num_threads")}
        if s["batching"] == "length-bucket":
            s["bucket_window_s"] = t.suggest_categorical("bucket_window_s",
                                                         self.space["bucket_window_s"])
        if s["batching"] != "continuous":
            s["max_batch_size"] = t.suggest_categorical("max_batch_size",
                                                        self.space["max_batch_size"])
            s.pop("prefill_join_tokens")
        if s["kv_manager"] == "paged":
            s["enable_prefix_caching"] = t.suggest_categorical(
                "enable_prefix_caching", self.space["enable_prefix_caching"])
        return s


def pareto_front(trials: Sequence[Trial]) -> list[Trial]:
    """Trials no other beats on throughput and both P99 latencies at once."""
    ok = [t for t in trials if not t.error]

    def dominates(a: Trial, b: Trial) -> bool:
        no_worse = (a.throughput >= b.throughput and a.p99_ttft_ms <= b.p99_ttft_ms
                    and a.p99_tpot_ms <= b.p99_tpot_ms)
        better = (a.throughput > b.throughput or a.p99_ttft_ms < b.p99_ttft_ms
                  or a.p99_tpot_ms < b.p99_tpot_ms)
        return no_worse and better
    return [t for t in ok if not any(dominates(o, t) for o in ok if o is not t)]

"""StartupTuner: the worker's start-up measurements behind one object, which returns a
:class:`~kvserve.worker.tuning.plan.TuningPlan`.

The worker calls one method per start-up step, where that step belongs among loading,
allocating and warming up. Each method applies the plan's choice where the plan has one
and otherwise measures (the modules beside this one say how and why), applies and
records it; a setting the user gave wins over both and is not recorded. The GEMM
kernels' generation is run here too, every start: it fills oneDNN's caches in this
process, which no plan can carry over.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from kvserve.logger import init_logger
from kvserve.model.execution import ExecutionMode, configure_layers
from kvserve.model.linear_method import FloatLinearMethod
from kvserve.worker.captured_step import MAX_ROWS as CAPTURED_MAX_ROWS, choose_captured_rows
from kvserve.worker.tuning.gemm_warmup import warm_gemm_kernels
from kvserve.worker.tuning.gemv_weights import choose_gemv_weights, set_gemv_weights
from kvserve.worker.tuning.panel_gemm import ALL_ROWS, ROW_LADDER, choose_panel_rows, \
    panel_linears, set_panel_rows
from kvserve.worker.tuning.plan import TuningPlan
from kvserve.worker.tuning.row_padding import measure_min_rows, named_packed_linears
from kvserve.worker.tuning.small_gemm import apply_layer_paths, choose_layer_paths, \
    path_counts

logger = init_logger(__name__)


def _ms(times: dict[int, tuple[float, float]]) -> str:
    return ", ".join(f"{n}: {1000 * a:.2f} -> {1000 * b:.2f}" for n, (a, b) in times.items())


class StartupTuner:
    def __init__(self, plan: TuningPlan, which: str = "") -> None:
        """``which``: the model's name in log lines ("draft model: "; "" for the
        target)."""
        self.plan = plan
        self.which = which

    def _loaded(self, what: str, value) -> None:
        logger.info("%s%s: %s (the tuning plan's)", self.which, what, value)

    # -- the weights' layouts and paths -------------------------------------------------

    def gemv_weights(self, model, kernels) -> None:
        """Which copy the few-row GEMV reads (the model's layers have their panels)."""
        if not any(m.method.panel_weight is not None for m in panel_linears(model)):
            return
        if self.plan.gemv_reads_panels is not None:
            set_gemv_weights(model, self.plan.gemv_reads_panels)
            self._loaded("few-row GEMV reads", "the panels" if self.plan.gemv_reads_panels
                         else "the dense weights")
            return
        times = choose_gemv_weights(model, kernels)
        if not times:
            return
        on_panels = all(m.method.gemv_reads_panels for m in panel_linears(model))
        self.plan.record("gemv_reads_panels", on_panels)
        logger.info("%sfew-row GEMV reads the %s (one pass over the layers by rows, "
                    "dense -> panels, ms: %s)", self.which,
                    "panels" if on_panels else "dense weights", _ms(times))

    def panel_rows(self, model, kernels, given: int | None,
                   time_steps: Callable[[list[int]], dict[int, float]], prompt_rows: int
                   ) -> None:
        """The native panel GEMM's rows: ``given`` (a setting), the plan's, or measured
        on decode steps (``time_steps``) and lone GEMMs of ``prompt_rows`` rows."""
        low = FloatLinearMethod.panel_min_rows
        if given is not None:
            rows = set_panel_rows(model, kernels, given)
            logger.info("panel GEMM %s (panel_gemm_max_rows)",
                        f"for {low}-{given} rows" if rows else "off")
            return
        if self.plan.panel_max_rows is not None:
            rows = set_panel_rows(model, kernels, self.plan.panel_max_rows)
            self._loaded("panel GEMM", self._panel_taken(rows))
            return
        rows, times = choose_panel_rows(model, kernels, time_steps, prompt_rows=prompt_rows)
        if not times:
            return
        self.plan.record("panel_max_rows", rows)
        timed = ", ".join(f"{n}: {1000 * o:.2f} -> {1000 * p:.2f}"
                          + (" lone GEMMs" if n > max(ROW_LADDER) else "")
                          for n, (o, p) in times.items())
        logger.info("panel GEMM %s (decode steps by rows, oneDNN -> panel, ms: %s)",
                    self._panel_taken(rows), timed)

    @staticmethod
    def _panel_taken(rows: int) -> str:
        low = FloatLinearMethod.panel_min_rows
        return (f"from {low} rows" if rows >= ALL_ROWS else
                f"for {low}-{rows} rows" if rows else "not taken")

    def warm_gemms(self, model, max_rows: int) -> None:
        """oneDNN's kernels generated for every row count up to ``max_rows`` (0: off)."""
        if not max_rows:
            return
        start = time.perf_counter()
        shapes, warmed = warm_gemm_kernels(model, max_rows)
        if shapes:
            capped = f" (of {max_rows}: the kernel caches' room)" if warmed < max_rows else ""
            logger.info("%sGEMM kernels generated for %d shapes x 1-%d rows%s in %.1fs",
                        self.which, shapes, warmed, capped, time.perf_counter() - start)

    def captured_rows(self, runner) -> None:
        """The decode steps the runner's captured step takes (None: it has none)."""
        captured = runner.captured
        if captured is None:
            return
        if self.plan.captured_max_rows is not None:
            captured.max_rows = self.plan.captured_max_rows
            self._loaded("captured step", f"for 1-{captured.max_rows} rows"
                         if captured.max_rows else "not taken")
            return
        times = choose_captured_rows(runner, captured)
        rows = captured.max_rows
        self.plan.record("captured_max_rows", rows)
        logger.info("%scaptured step %s%s", self.which,
                    f"for 1-{rows} rows" if rows else "not taken",
                    f" (decode steps by rows, eager -> captured, ms: {_ms(times)})"
                    if times else "")

    @staticmethod
    def captured_takes_every_few_row_step(runner) -> bool:
        captured = runner.captured
        return captured is not None and captured.max_rows == CAPTURED_MAX_ROWS

    def linear_min_rows(self, model, mode: ExecutionMode) -> ExecutionMode:
        """The row padding of packed GEMMs: the plan's, or measured on the model's
        unpadded layers; returns the mode with it (the layers configured with it)."""
        rows = self.plan.linear_min_rows
        if rows is not None:
            self._loaded("packed GEMMs padded to", f"{rows} rows")
        else:
            rows, pass_times = measure_min_rows(model)
            if pass_times:
                self.plan.record("linear_min_rows", rows)
                logger.info("%slinear layers, one pass at 1-%d rows (ms): %s; %s", self.which,
                            len(pass_times),
                            " ".join(f"{1000 * t:.2f}" for t in pass_times.values()),
                            f"GEMMs of fewer rows run padded to {rows}" if rows > 1
                            else "no padding (no row count clearly faster)")
        mode = dataclasses.replace(mode, linear_min_rows=rows)
        configure_layers(model, mode)
        return mode

    def layer_paths(self, model, kernels) -> None:
        """Each packed layer's few-row path: the plan's, or measured (a layer whose runs
        take its few-row steps has none to choose)."""
        named = [(name, m) for name, m in named_packed_linears(model)
                 if not getattr(m.method, "runs_max_rows", 0)]
        if not named:
            return
        names = [name for name, _ in named]
        linears = [m for _, m in named]
        planned = self.plan.layer_paths
        if planned is not None and set(planned) == set(names):
            apply_layer_paths(linears, [planned[n] for n in names], kernels)
            self._loaded("few-row paths", ", ".join(
                f"{n} {p}" for p, n in sorted(path_counts(list(planned.values())).items())))
            return
        paths = choose_layer_paths(linears, native=kernels)
        self.plan.record("layer_paths", dict(zip(names, paths)))
        chosen = {k: n for k, n in path_counts(paths).items() if k != "packed"}
        if chosen:
            logger.info("%sfew-row GEMMs off oneDNN's packed path (faster, measured): %s of "
                        "%d layers", self.which,
                        ", ".join(f"{n} {k}" for k, n in sorted(chosen.items())), len(paths))

    # -- step costs --------------------------------------------------------------------

    def timings(self, name: str, rows: list[int],
                measure: Callable[[list[int]], dict[int, float]]) -> dict[int, float]:
        """Seconds by rows for each of ``rows``: the plan's ``name`` table where it has
        them, the others measured (``measure``) and recorded; a count ``measure`` could
        not run (no room in the pool) is recorded as 0 and left out."""
        known = self.plan.timings.get(name, {})
        missing = [r for r in rows if r not in known]
        if missing:
            new = measure(missing)
            self.plan.record_timing(name, {r: new.get(r, 0.0) for r in missing})
        else:
            self._loaded(f"{name.replace('_', ' ')} timed", f"{len(rows)} row counts")
        table = self.plan.timings[name]
        return {r: table[r] for r in rows if table[r] > 0}

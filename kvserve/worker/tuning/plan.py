"""TuningPlan: what the worker's start-up measurements chose, as data, saved.

Start-up times kernels on the model's own layers (which copy of the weights the few-row
GEMV reads, the panel GEMM's rows, the captured step's rows, the row padding, each
layer's few-row path) and the step costs speculative decoding weighs drafts with. The
measuring takes seconds, and its choices move with the machine's noise from one start to
the next. A plan keeps the choices under a key of everything they depend on (the CPU's
model and flags, the kernel build, torch, the model's shape and dtype, the threads and
the worker's settings); a later start with the same key applies them without measuring:
it starts sooner and runs the same kernels.

Plans live in ``$KVSERVE_CACHE_DIR/tuning`` (``~/.cache/kvserve/tuning``), one file per
key; ``--tuning-plan PATH`` loads one from PATH instead (or saves it there once
measured), ``--no-tuning-cache`` measures every time.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvserve.kernels.build import cache_root, cpu_identity

PLAN_FORMAT = 1

# the choices, in the order start-up makes them (what ``describe`` prints)
CHOICES = ("gemv_reads_panels", "panel_max_rows", "captured_max_rows", "linear_min_rows",
           "layer_paths", "timings")


class PlanMismatchError(ValueError):
    """A plan given by path was measured for another machine, model or setting."""


@dataclass
class TuningPlan:
    """One worker's start-up choices for one model; a field left None was not measured
    (that start-up step did not run, or a setting decided it) and is measured when a
    start needs it."""

    key: dict[str, Any]
    gemv_reads_panels: bool | None = None  # the few-row GEMV reads the panels, not dense
    panel_max_rows: int | None = None      # the native panel GEMM up to this many rows
    captured_max_rows: int | None = None   # decode steps of 1..n rows run captured
    linear_min_rows: int | None = None     # packed GEMMs of fewer rows run padded
    layer_paths: dict[str, str] | None = None  # layer name -> packed | dense<=r | native<=r
    # measured step costs by name, seconds by rows ("steps": the target's decode steps,
    # "draft_passes" / "draft_catch_ups": the draft model's); 0: no room to run it
    timings: dict[str, dict[int, float]] = field(default_factory=dict)
    measured: list[str] = field(default_factory=list, compare=False, repr=False)

    def record(self, name: str, value: Any) -> None:
        """Set choice ``name`` as just measured (the plan then needs saving)."""
        setattr(self, name, value)
        self.measured.append(name)

    def record_timing(self, name: str, seconds: dict[int, float]) -> None:
        self.timings[name] = {**self.timings.get(name, {}), **seconds}
        self.measured.append(f"timings.{name}")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("measured")
        data["timings"] = {name: {str(rows): s for rows, s in sorted(times.items())}
                           for name, times in self.timings.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> TuningPlan:
        names = {f.name for f in dataclasses.fields(cls)} - {"measured"}
        unknown = set(data) - names
        if unknown or "key" not in data:
            raise ValueError(f"{source} is not a kvserve tuning plan (fields "
                             f"{sorted(unknown) or 'without key'}); its fields: {sorted(names)}")
        timings = {name: {int(rows): float(s) for rows, s in times.items()}
                   for name, times in (data.get("timings") or {}).items()}
        return cls(**{**data, "timings": timings})

    def describe(self) -> str:
        """The choices, a line each (what ``kvserve serve`` logs and ``tune`` prints)."""
        lines = []
        for name in CHOICES:
            value = getattr(self, name)
            if name == "layer_paths" and value:
                counts: dict[str, int] = {}
                for path in value.values():
                    counts[path] = counts.get(path, 0) + 1
                value = ", ".join(f"{n} {p}" for p, n in sorted(counts.items()))
            elif name == "timings":
                value = "; ".join(f"{n}: " + " ".join(f"{r}:{1000 * s:.2f}ms"
                                                      for r, s in sorted(t.items()))
                                  for n, t in sorted(value.items())) or None
            if value is not None:
                lines.append(f"{name}: {value}")
        return "\n".join(lines) or "(nothing measured)"


def model_shape(arch) -> dict[str, Any]:
    """What of a model's config its layers' shapes and kernels depend on."""
    return {name: getattr(arch, name) for name in (
        "architecture", "vocab_size", "hidden_size", "num_layers", "num_heads",
        "num_kv_heads", "head_dim", "intermediate_size", "hidden_act",
        "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias")}


def plan_key(arch, dtype: torch.dtype, kernel_build: str | None,
             settings: dict[str, Any]) -> dict[str, Any]:
    """The key of a plan: the CPU, the kernel build (None: torch's paths only), torch, the
    model's shape and dtype, and the worker ``settings`` that change what start-up
    measures (threads, rank, huge pages, the prompt steps' rows...)."""
    return {"format": PLAN_FORMAT, "cpu": cpu_identity(), "kernels": kernel_build,
            "torch": torch.__version__, "model": model_shape(arch),
            "dtype": str(dtype).removeprefix("torch."), **settings}


def plan_cache_dir() -> Path:
    return cache_root() / "tuning"


def cache_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return plan_cache_dir() / f"plan-{digest}.json"


def plan_path(given: str | Path | None, which: str = "", rank: int = 0) -> Path | None:
    """Where ``--tuning-plan PATH`` puts one worker's plan: PATH for the target model on
    rank 0; beside it one for each other rank (``PATH.rank1.json``) and for a draft model
    (``which`` "draft": ``PATH.draft.json``). None where no path was given."""
    if given is None:
        return None
    path = Path(given)
    parts = ([which] if which else []) + ([f"rank{rank}"] if rank else [])
    return path.with_name(".".join([path.stem, *parts]) + path.suffix) if parts else path


def read_plan(path: Path) -> TuningPlan:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the tuning plan {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a kvserve tuning plan (a JSON object)")
    return TuningPlan.from_dict(data, str(path))


def key_differences(found: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    return [name for name in sorted(set(found) | set(wanted))
            if found.get(name) != wanted.get(name)]


def write_plan(plan: TuningPlan, path: Path) -> None:
    """Write atomically: another engine starting at the same moment reads a whole plan
    or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".plan-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(plan.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)


class PlanStore:
    """Where one worker's plan comes from and goes. ``path`` (``--tuning-plan``): loaded
    if it exists (its key checked), else the plan is taken from the cache or measured,
    and written there. The cache (``cached``): read where no path holds the plan,
    written whenever a start measured something. Neither: every start measures."""

    def __init__(self, path: str | Path | None, cached: bool) -> None:
        self.path = Path(path) if path is not None else None
        self.cached = cached
        self.source = "measured"  # or where the plan was loaded from

    def load(self, key: dict[str, Any]) -> TuningPlan:
        """The plan for ``key``: the one stored, or an empty one. A plan given by path
        and measured for another key is refused, naming what differs; a cached one of
        another key (a hash collision, a hand edit) is measured anew."""
        if self.path is not None and self.path.is_file():
            plan = read_plan(self.path)
            differs = key_differences(plan.key, key)
            if differs:
                raise PlanMismatchError(
                    f"the tuning plan {self.path} was measured for another "
                    f"{', '.join(differs)} than this engine's; remove it (it is measured "
                    "and saved again) or give another --tuning-plan path")
            self.source = str(self.path)
            return plan
        cached = cache_path(key)
        if self.cached and cached.is_file():
            plan = read_plan(cached)
            if not key_differences(plan.key, key):
                self.source = str(cached)
                return plan
        return TuningPlan(key)

    def save(self, plan: TuningPlan) -> list[Path]:
        """Write the plan where it belongs: to the cache if this start measured
        something, to the path if given and it measured something or the path has no
        plan yet. Returns where it was written."""
        targets = []
        if self.cached and plan.measured:
            targets.append(cache_path(plan.key))
        if self.path is not None and (plan.measured or not self.path.is_file()):
            targets.append(self.path)
        for target in targets:
            write_plan(plan, target)
        plan.measured.clear()
        return targets

"""Printing and saving benchmark results: the machine line, settings, tables, JSON.

Every benchmark prints the workload, the settings and the machine, so a number is
never read without what produced it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvserve.bench.reports import provenance

__all__ = [
    "machine_info",
    "machine_line",
    "print_settings",
    "format_table",
    "to_jsonable",
    "write_json",
]


def _cpu_model() -> tuple[str, int | None, dict[str, Any]]:
    """CPU model name, physical core count and (family, model, vector ISA) from
    /proc/cpuinfo (Linux): the name alone does not tell a Zen 2 from a Zen 5."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown", None, {}
    model, cores, phys, ident = "unknown", set(), "", {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and model == "unknown":
            model = value
        elif key == "physical id":
            phys = value
        elif key == "core id":
            cores.add((phys, value))
        elif key in ("cpu family", "model"):
            ident.setdefault("cpu_family" if key == "cpu family" else "cpu_model_number",
                             int(value))
        elif key == "flags" and "vector_isa" not in ident:
            flags = set(value.split())
            ident["vector_isa"] = ("avx512" if "avx512f" in flags else
                                   "avx2" if "avx2" in flags else "other")
    return model, len(cores) or None, ident


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """The machine, the software and the code a benchmark ran on (its commit, whether
    the tree was dirty, the date), and this process's CPU set."""
    import torch

    model, physical, ident = _cpu_model()
    return {
        **provenance.code_provenance(),
        "cpu_model": model,
        **ident,
        "cpu_flags": provenance.cpu_flags(),
        "process_cpus": provenance.process_cpus(),
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "transformers_version": _version("transformers"),
        "kvserve_version": _version("kvserve"),
    }


def machine_line(info: Mapping[str, Any]) -> str:
    """One line: CPU, cores, torch version and threads."""
    cores = info.get("physical_cores") or info.get("logical_cores")
    return (
        f"machine: {info.get('cpu_model')} (family {info.get('cpu_family')}, model "
        f"{info.get('cpu_model_number')}, {info.get('vector_isa')}) | {cores} cores "
        f"({info.get('logical_cores')} logical)"
        f" | torch {info.get('torch_version')} | {info.get('torch_threads')} threads"
        f" | python {info.get('python')}"
        f" | CPUs {','.join(map(str, info.get('process_cpus') or [])) or '?'}"
        f" | commit {(info.get('commit') or 'unknown')[:12]}"
        f"{' (uncommitted changes)' if info.get('tree_dirty') else ''}"
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def print_settings(title: str, settings: Mapping[str, Any]) -> None:
    """Print a titled block of ``key: value`` lines."""
    print(f"== {title}")
    width = max((len(str(k)) for k in settings), default=0)
    for key, value in settings.items():
        print(f"  {str(key).ljust(width)} : {_fmt(value)}")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def to_jsonable(obj: Any) -> Any:
    """Convert results (dataclasses, objects with ``to_dict``, paths, inf) to JSON types."""
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return to_jsonable(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return str(obj)
    if isinstance(obj, Path):
        return str(obj)
    return obj


# an absolute path on the machine that ran the bench (a venv, a model, a temp file)
_MACHINE_PATH = re.compile(r"(?<![\w.:/])/(?:work|tmp|home|root|opt|usr|var|mnt|srv|data"
                           r"|Users|private|scratch)(?:/[^\s'\"=,;()\[\]{}<>]+)+")


def without_machine_paths(obj: Any) -> Any:
    """``obj`` with every absolute path in its strings cut to its last component (a
    result records commands and settings, not where this machine keeps its files)."""
    if isinstance(obj, str):
        return _MACHINE_PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1], obj)
    if isinstance(obj, dict):
        return {k: without_machine_paths(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [without_machine_paths(v) for v in obj]
    return obj


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON (creating parent directories), its machine paths
    cut (:func:`without_machine_paths`); returns the path. Refused (DirtyTreeError) into
    docs/results/ from a tree with uncommitted changes."""
    provenance.check_results_target(path)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(without_machine_paths(to_jsonable(obj)), indent=2) + "\n")
    return p

"""What the bench commands share at both ends: the settings and machine printed first,
and the JSON record of a run written last."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvserve.bench.bench_args import engine_args_from, resolve_model_dir, workload_from_args
from kvserve.bench.reports import report


def _header(title: str, settings: dict[str, Any]) -> dict[str, Any]:
    info = report.machine_info()
    report.print_settings(title, settings)
    print(report.machine_line(info))
    return info


def _wl_settings(wl: Any) -> dict[str, Any]:
    d = wl.describe()
    return {"workload": d.pop("name"), **d}


def rounds_bench_setup(args: argparse.Namespace, title: str):
    """What an A/B rounds bench starts from: (model dir, engine args, workload, machine
    info), the settings printed."""
    model_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    wl = workload_from_args(args, model_dir)
    info = _header(title, {"model": model_dir.name, **_wl_settings(wl),
                           "engine_args": engine_args, "rounds": args.rounds})
    return model_dir, engine_args, wl, info


def write_result_json(path: str | Path, info: dict[str, Any], model_dir: Path, wl: Any,
                      engine_args: dict[str, Any], result: Any, **extra: Any) -> None:
    """The run's record: the machine, the model, the workload, the settings (``extra``:
    the bench's own), the result."""
    out = {"machine": info, "model": model_dir.name, "settings": _wl_settings(wl),
           **extra, "engine_args": engine_args, "result": result}
    print(f"wrote {report.write_json(path, out)}")

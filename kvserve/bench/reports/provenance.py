"""Where a result came from: the code's commit, the date, the CPU's flags, the CPU set.

Every results JSON carries these (through :func:`kvserve.bench.reports.report.machine_info`), so a
figure can be traced to the code that produced it. A result meant for the repository's
own ``docs/results/`` must come from committed code: :func:`check_results_target`
refuses to write there from a tree with uncommitted changes.
"""
from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["code_provenance", "cpu_flags", "check_results_target", "DirtyTreeError",
           "REPO_ROOT"]

# the checkout this package was imported from (None when installed from a wheel)
_PACKAGE_DIR = Path(__file__).resolve().parents[2]

# the flags a kernel choice or a peer's build depends on
CPU_FLAGS_OF_INTEREST = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                         "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
                         "amx_tile", "amx_bf16", "amx_int8")


class DirtyTreeError(RuntimeError):
    """A result for docs/results/ from code that is not committed."""


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(_PACKAGE_DIR), *args], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.rstrip() if proc.returncode == 0 else None


def _repo_root() -> Path | None:
    top = _git("rev-parse", "--show-toplevel")
    return Path(top) if top and (Path(top) / "kvserve").resolve() == _PACKAGE_DIR else None


REPO_ROOT = _repo_root()


def _dirty_paths(ignore: Path | None = None) -> list[str]:
    """Paths with uncommitted changes (untracked files included, except results under
    docs/results/ and ``ignore``)."""
    out = _git("status", "--porcelain", "--untracked-files=all") or ""
    paths = []
    for line in out.splitlines():
        status, path = line[:2], line[3:]
        if status == "??" and path.startswith("docs/results/"):
            continue  # results written earlier, waiting for their commit
        if ignore is not None and REPO_ROOT is not None and REPO_ROOT / path == ignore:
            continue
        paths.append(path)
    return paths


def code_provenance() -> dict[str, Any]:
    """The commit this package runs from, whether the tree had uncommitted changes, and
    the date (UTC)."""
    commit = _git("rev-parse", "HEAD") if REPO_ROOT is not None else None
    dirty = _dirty_paths() if commit else []
    return {
        "commit": commit,
        "tree_dirty": bool(dirty) if commit else None,
        "dirty_paths": dirty[:20],
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def cpu_flags() -> list[str]:
    """The vector ISA flags of interest this CPU reports (from /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [f for f in CPU_FLAGS_OF_INTEREST if f in have]
    return []


def process_cpus() -> list[int]:
    """This process's CPU mask now."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def check_results_target(path: str | Path) -> None:
    """Raise :class:`DirtyTreeError` when ``path`` is in this checkout's ``docs/results/``
    and the checkout has uncommitted changes: a published figure must name the commit
    that produced it."""
    if REPO_ROOT is None:
        return
    target = Path(path).resolve()
    results = (REPO_ROOT / "docs" / "results").resolve()
    if results not in target.parents:
        return
    dirty = _dirty_paths(ignore=target)
    if dirty:
        shown = ", ".join(dirty[:5]) + (f" and {len(dirty) - 5} more" if len(dirty) > 5 else "")
        raise DirtyTreeError(f"refusing to write {target.name} into docs/results/: the tree "
                             f"has uncommitted changes ({shown}); commit them first, or "
                             "write the result elsewhere")

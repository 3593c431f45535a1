"""Building the C kernels: the compiler, the cache, and the key a build is cached under.

A build is ``-march=native``: its instructions are the building CPU's. The cache may
sit in a shared home or a container image that other machines read, so a build is
keyed by everything it depends on: the sources and headers, the flags, the CPU (model
and feature flags) and the compiler (its ``--version``). :func:`build_key` is that key;
a tuning plan measured over these kernels keys itself by it too.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / n for n in ("paged_attention.c", "elementwise.c", "int8_linear.c",
                                    "threads.c", "gemv.c", "gemm.c", "decode_step.c",
                                    "lora.c", "gguf_linear.c", "int4_linear.c",
                                    "moe_route.c", "int8_runs.c", "bf16_runs.c"))
HEADERS = tuple(_HERE / n for n in ("vec_math.h", "paged_attention_tiles.h",
                                    "paged_attention_rows.h", "step_parts.h", "team.h",
                                    "gguf_k_x4.h", "gguf_q6_k_x4.h", "gguf_q8_0_x8.h",
                                    "gguf_float_rows.h", "gguf_int8_rows.h", "gguf_bf16_rows.h",
                                    "gguf_runs.h", "row_runs.h"))
BASE_FLAGS = ("-O3", "-march=native")
LINK_FLAGS = ("-fopenmp", "-shared", "-fPIC")
# /proc/cpuinfo fields that say which instructions -march=native may use: x86's model
# and flags, Arm's implementer, part and features
CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "flags", "CPU implementer",
              "CPU architecture", "CPU variant", "CPU part", "Features")
NO_COMPILER = "no C compiler"


class NoCompilerError(RuntimeError):
    """No C compiler was found: the kernels cannot be built here."""


def cache_root() -> Path:
    """``$KVSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvserve`` (``~/.cache/kvserve``):
    what kvserve builds and measures once per machine (kernels, tuning plans)."""
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve"))


def cache_dir() -> Path:
    """The kernels' builds: ``cache_root()/kernels``."""
    return cache_root() / "kernels"


def find_compiler() -> str | None:
    """The compiler's path: ``$CC`` when set, else ``cc`` or ``gcc`` on PATH; None when
    there is none."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return shutil.which("cc") or shutil.which("gcc")


def missing_compiler_reason() -> str:
    """What :func:`find_compiler` looked for, for a reader who has to install it."""
    named = os.environ.get("CC")
    looked = f"CC={named} not found" if named else "neither cc nor gcc on PATH"
    return f"{NO_COMPILER} ({looked})"


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_has_any(*flags: str) -> bool:
    """Whether the CPU reports any of ``flags`` (/proc/cpuinfo's names; False where
    there is none)."""
    return not _cpu_flags().isdisjoint(flags)


def cpu_identity() -> str:
    """The CPU's model and feature flags (the first processor's; every core of the
    machines kvserve runs on is one model), from /proc/cpuinfo, else what ``platform``
    knows (the architecture and, where the OS says, the processor)."""
    try:
        first = Path("/proc/cpuinfo").read_text(errors="replace").split("\n\n", 1)[0]
    except OSError:
        first = ""
    fields = {}
    for line in first.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip()] = value.strip()
    found = [f"{name}: {fields[name]}" for name in CPU_FIELDS if name in fields]
    return "\n".join(found) or f"{platform.machine()} {platform.processor()}".strip()


def compiler_identity(compiler: str | None) -> str:
    """The first line of ``compiler --version``; the compiler's path, size and time
    when it prints none; :data:`NO_COMPILER` for None."""
    if compiler is None:
        return NO_COMPILER
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=30)
        first = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        first = ""
    if first:
        return first
    path = Path(compiler).resolve()
    try:
        stat = path.stat()
    except OSError:
        return str(path)
    return f"{path} {stat.st_size} {stat.st_mtime_ns}"


def build_key(extra_flags: tuple[str, ...] = (), compiler: str | None = None) -> str:
    """The key of a build of the kernels here with ``extra_flags``: a hash of the sources,
    headers, flags, :func:`cpu_identity` and :func:`compiler_identity` (of ``compiler``,
    else :func:`find_compiler`'s)."""
    compiler = compiler or find_compiler()
    digest = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS),
                 " ".join((*BASE_FLAGS, *extra_flags, *LINK_FLAGS)).encode(),
                 cpu_identity().encode(), compiler_identity(compiler).encode()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def build_library(extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library of the kernels built with ``extra_flags``: from the cache, or
    compiled into it. Raises NoCompilerError without a compiler and
    CalledProcessError when the compiler fails."""
    compiler = find_compiler()
    if compiler is None:
        raise NoCompilerError(missing_compiler_reason())
    target = cache_dir() / f"kvserve-kernels-{build_key(extra_flags, compiler)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *BASE_FLAGS, *extra_flags, *LINK_FLAGS, *map(str, SOURCES),
               "-o", str(out), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(out, target)  # atomic: concurrent builders never see half a file
    return target

"""Facts about the host CPU and memory that sizing decisions depend on, and the one
process-wide allocator setting the engine makes."""
from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

from kvserve.config import parse_cpu_list


# The CPUs this process may run on, read at import: binding the compute threads narrows
# the compute thread's own mask, which later engines in the process must not take for
# the machine's.
_CPUS_AT_START = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") \
    else ()


def allowed_cpus() -> list[int]:
    """The CPUs this process could run on when it started."""
    return list(_CPUS_AT_START)


def _core_of(cpu: int) -> tuple[str, str]:
    topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return ((topo / "physical_package_id").read_text().strip(),
                (topo / "core_id").read_text().strip())
    except OSError:
        return ("?", str(cpu))


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may run on."""
    cores = {_core_of(cpu) for cpu in allowed_cpus()}
    return max(1, len(cores) or os.cpu_count() or 1)


def one_cpu_per_core() -> list[int]:
    """The lowest-numbered CPU of each physical core this process may run on, in order
    (a hyperthread sibling would share its core's FMA units with a compute thread)."""
    first: dict[tuple[str, str], int] = {}
    for cpu in allowed_cpus():
        first.setdefault(_core_of(cpu), cpu)
    return sorted(first.values())


def cpus_to_bind(setting: str, num_threads: int) -> list[int] | None:
    """The CPU for each compute thread under ``omp_threads_bind`` (see EngineArgs): "auto"
    takes one CPU per physical core, none when there are fewer cores than threads;
    "nobind": none; otherwise the listed CPUs, one per thread, all allowed to this
    process."""
    if setting == "nobind":
        return None
    if setting == "auto":
        cpus = one_cpu_per_core()
        return cpus[:num_threads] if len(cpus) >= num_threads else None
    cpus = parse_cpu_list(setting)
    if len(cpus) != num_threads:
        raise ValueError(f"omp_threads_bind {setting!r} names {len(cpus)} CPUs for "
                         f"{num_threads} compute threads; name one per thread")
    outside = sorted(set(cpus) - set(allowed_cpus()))
    if outside:
        raise ValueError(f"omp_threads_bind {setting!r}: CPUs {outside} are not available "
                         f"to this process (allowed: {allowed_cpus()})")
    return cpus


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (falls back to total physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# glibc mallopt() parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
KEEP_HEAP_BYTES = 1 << 30
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit


def _glibc():
    """The process's own C library symbols, where that library is glibc; else None."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
    except (ValueError, OSError, AttributeError):  # not a glibc system
        return None
    return ctypes.CDLL(None)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed activation memory instead of returning it to the OS.

    A step's activations are a few MB each (a 512-token prefill: ~8 MB for the MLP);
    by default glibc serves such blocks with mmap and unmaps them on free, so every
    step faults its pages back in, zero-filled by the kernel; with this setting a
    prefill takes no page faults and runs faster.
    Blocks up to 32 MB now come from the heap, and up to 1 GiB of freed heap is kept
    for reuse. Returns False where the C library is not glibc.
    """
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                                     and libc.mallopt(_M_TRIM_THRESHOLD, KEEP_HEAP_BYTES))


def return_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS now (glibc's malloc_trim): what the
    setting above keeps for reuse would otherwise stay with the process, what start-up
    freed among it. Returns False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def freeze_startup_objects() -> int:
    """Take every object alive after start-up (imported modules, the model's modules and
    parameters, a great many objects) out of the garbage collector's reach, as vLLM
    does after its start-up. A full collection walked them all while the engine stood
    still: a stall in the latency of whichever requests were running. Objects created
    later are collected as usual. Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

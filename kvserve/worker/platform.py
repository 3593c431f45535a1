"""Facts about the host CPU and memory that sizing decisions depend on, and the one
process-wide allocator setting the engine makes."""
from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may run on."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("?", str(cpu)))
    return max(1, len(cores) or os.cpu_count() or 1)


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


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed activation memory instead of returning it to the OS.

    A step's activations are a few MB each (a 512-token prefill: ~8 MB for the MLP);
    by default glibc serves such blocks with mmap and unmaps them on free, so every
    step faults its pages back in, zero-filled by the kernel: a 448-token prefill of
    bench-100m took 3,000-12,000 page faults and 390-450 ms, and with this setting 0
    faults and 372-380 ms. Blocks up to 32 MB now come from the heap, and up to 1 GiB
    of freed heap is kept for reuse. Returns False where the C library is not glibc.
    """
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return False
    except (ValueError, OSError, AttributeError):  # not a glibc system
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols, glibc's among them
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and libc.mallopt(_M_TRIM_THRESHOLD, KEEP_HEAP_BYTES))


def freeze_startup_objects() -> int:
    """Take every object alive after start-up (imported modules, the model's modules and
    parameters: ~290,000 with bench-100m) out of the garbage collector's reach, as vLLM
    does after its start-up. A full collection walked them all, ~130 ms during which the
    engine stood still: a stall in the latency of whichever requests were running.
    Objects created later are collected as usual. Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

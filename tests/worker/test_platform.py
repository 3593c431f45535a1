"""Host facts, the allocator setting and the start-up freeze."""
from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys

import pytest

from kvserve.worker import platform as host
from kvserve.worker.platform import available_memory_bytes, freeze_startup_objects, \
    one_cpu_per_core, physical_cores


def test_hyperthread_siblings_count_as_one_core(monkeypatch):
    # CPUs 0-5 of which 0/3, 1/4, 2/5 are siblings, on one package; only 1-5 allowed
    monkeypatch.setattr(host, "allowed_cpus", lambda: [1, 2, 3, 4, 5])
    monkeypatch.setattr(host, "_core_of", lambda cpu: ("0", str(cpu % 3)))
    assert physical_cores() == 3
    assert one_cpu_per_core() == [1, 2, 3]  # the lowest allowed CPU of each core
    monkeypatch.setattr(host, "_core_of", lambda cpu: (str(cpu % 2), "0"))  # two packages
    assert physical_cores() == 2 and one_cpu_per_core() == [1, 2]


def test_available_memory_is_within_the_machine():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < available_memory_bytes() <= total


_HEAP_GROWTH = """
import ctypes, sys, torch
from kvserve.worker.platform import keep_freed_memory
libc = ctypes.CDLL(None)
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = libc.sbrk(0)
x = torch.empty((20 << 20) // 4)  # 20 MB: above glibc's default mmap threshold
x.fill_(1.0)
print(libc.sbrk(0) - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_activation_sized_blocks_come_from_the_heap():
    """In a fresh process each: by default glibc serves a 20 MB block with mmap (a
    fresh mapping, unmapped again on free); with the setting it comes from the heap,
    which keeps freed memory for the next step."""
    def heap_growth(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _HEAP_GROWTH, mode], check=True,
                             capture_output=True, text=True)
        return int(out.stdout.split()[-1])
    assert heap_growth("keep") >= 16 << 20  # most of it: the heap had some room
    assert heap_growth("default") < 1 << 20


_FREED_PAGES = """
import os, torch
from kvserve.worker.platform import keep_freed_memory, return_freed_memory
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
assert keep_freed_memory()
x = torch.empty((24 << 20) // 4)  # 24 MB from the heap
x.fill_(1.0)
y = torch.ones(16)  # above it, so that the heap's top does not shrink on free
del x
kept = resident()
assert return_freed_memory()
print(kept - resident())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_pages_go_back_to_the_os_when_asked():
    """What start-up frees (weights copied elsewhere or let go) is heap that the
    setting above would keep."""
    out = subprocess.run([sys.executable, "-c", _FREED_PAGES], check=True,
                         capture_output=True, text=True)
    assert int(out.stdout.split()[-1]) >= 16 << 20


def test_startup_objects_are_frozen_and_later_ones_still_collected():
    class Cycle:
        pass

    try:
        assert freeze_startup_objects() > 0
        frozen = gc.get_freeze_count()
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2  # a cycle made after the freeze is still found
        # the collection leaves the frozen objects frozen; the count may only fall by the
        # few that other threads of a long test session drop meanwhile
        assert frozen - 100 <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()

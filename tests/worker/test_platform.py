"""Host facts, the allocator setting and the start-up freeze."""
from __future__ import annotations

import gc
import platform
import resource

import pytest
import torch

from kvserve.worker.platform import available_memory_bytes, freeze_startup_objects, \
    keep_freed_memory, physical_cores


def test_host_facts_are_positive():
    assert physical_cores() >= 1
    assert available_memory_bytes() > 0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_activation_memory_is_reused_without_page_faults():
    assert keep_freed_memory()
    size = (16 << 20) // 4  # 16 MB: above glibc's default mmap threshold

    def touch() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(size)
        x.fill_(1.0)
        del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    for _ in range(4):  # the heap grows a few times while small allocations settle
        touch()
    assert sum(touch() for _ in range(4)) < 1000  # fresh 16 MB each time: ~16,000


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
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()

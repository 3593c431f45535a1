"""Weights and KV pools on transparent huge pages.

A decode step streams every weight and each running request's keys and values from
memory. On 4 KiB pages that stream crosses a page, and needs a TLB entry, every 64
cache lines; the TLB holds far fewer entries than a model has pages, so the stream
keeps stopping for page walks, most of all in attention over KV blocks scattered
through the pool. On 2 MiB pages it crosses one every 32768 lines.

Linux hands out huge pages for anonymous memory when its transparent-huge-page setting
(``/sys/kernel/mm/transparent_hugepage/enabled``) is ``always``, or ``madvise`` and the
range was marked with ``madvise(MADV_HUGEPAGE)``; torch's allocator marks nothing. So
the worker copies the model's tensors into one marked, 2 MiB-aligned mapping, and
allocates each KV pool as one. ``--no-huge-pages`` keeps torch's allocations.

A KV pool's pages are backed before steps write them: left to the first write, each
2 MiB fault would zero its page (and perhaps compact memory to find one) inside a step.
Backing hundreds of MiB can take a second or more where memory must be compacted, so
``PoolPages`` does it on a thread of its own once the engine has warmed up
(``MADV_POPULATE_WRITE``, Linux 5.14 on, which backs pages without writing them: steps
may write the pool meanwhile, the pages they reach first backed by their own writes);
where the kernel lacks it, it writes zeros at once, as torch.zeros would.
"""
from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import threading
from pathlib import Path

import torch
from torch import nn

from kvserve.logger import init_logger
from kvserve.worker.platform import allowed_cpus

logger = init_logger(__name__)

HUGE_PAGE = 2 * 2**20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADV_POPULATE_WRITE = 23  # Linux's (5.14 on); Python's mmap module names it only from 3.13
POPULATE_CHUNK = 32 * 2**20  # bytes backed per call: a stop request waits at most one
ALIGN = 64  # each tensor starts on a cache line


def huge_pages_setting() -> str:
    """The kernel's transparent-huge-page mode (always, madvise or never), or
    "unavailable" where the kernel or Python offers none."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "unavailable"
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return "unavailable"
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else "unavailable"


def huge_pages_available() -> bool:
    return huge_pages_setting() in ("always", "madvise")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class HugePageBuffer:
    """One anonymous mapping marked for huge pages, handed out as tensors from its
    first 2 MiB boundary on. The tensors keep the mapping alive."""

    def __init__(self, nbytes: int) -> None:
        size = -(-(nbytes + HUGE_PAGE) // HUGE_PAGE) * HUGE_PAGE  # room to align the start
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._next = -self._bytes.data_ptr() % HUGE_PAGE
        self._end = self._next + nbytes

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed contiguous tensor of the next free bytes."""
        nbytes = _nbytes(shape, dtype)
        start = -(-self._next // ALIGN) * ALIGN
        if start + nbytes > self._end:
            raise ValueError(f"the huge-page buffer has {self._end - start} bytes left; "
                             f"a {tuple(shape)} {dtype} tensor needs {nbytes}")
        self._next = start + nbytes
        return self._bytes[start:start + nbytes].view(dtype).view(shape)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on huge pages of its own, every page backed now: left
    to the first write, each 2 MiB fault would zero its page (and perhaps compact
    memory to find one) inside a step."""
    tensor = HugePageBuffer(_nbytes(shape, dtype)).take(tuple(shape), dtype)
    return tensor.zero_()


class PoolPages:
    """KV pools on huge pages of their own (``zeros``, torch.zeros' signature), backed on
    a thread once ``start`` is called; ``close`` stops and joins it."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._madvise = None  # libc's, once it has backed a page

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = HugePageBuffer(_nbytes(shape, dtype)).take(tuple(shape), dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes and self._can_populate(tensor.data_ptr()):
            self._ranges.append((tensor.data_ptr(), nbytes))
        else:
            tensor.zero_()  # an anonymous mapping reads as zeros already: this backs it
        return tensor

    def _can_populate(self, address: int) -> bool:
        """Whether the kernel backs pages on request (tried on the pool's first page)."""
        if self._madvise is None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                madvise = libc.madvise
            except (OSError, AttributeError):
                return False
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            if madvise(address - address % mmap.PAGESIZE, mmap.PAGESIZE,
                       MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS):
                    logger.debug("MADV_POPULATE_WRITE failed: %s", errno.errorcode.get(
                        ctypes.get_errno(), ctypes.get_errno()))
                return False
            self._madvise = madvise
        return True

    def start(self) -> None:
        if self._ranges and self._thread is None:
            self._thread = threading.Thread(target=self._populate, name="kvserve-kv-pages",
                                            daemon=True)
            self._thread.start()

    def _populate(self) -> None:
        # started from the compute thread, this one inherits its single-CPU binding:
        # it runs where the process may instead
        if allowed_cpus() and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, allowed_cpus())
        for address, nbytes in self._ranges:
            first = address - address % mmap.PAGESIZE
            end = address + nbytes
            for at in range(first, end, POPULATE_CHUNK):
                if self._stop.is_set():
                    return
                # ctypes lets go of the GIL for the call; a failure (memory short) leaves
                # the rest to be backed by the steps' own writes
                if self._madvise(at, min(POPULATE_CHUNK, end - at), MADV_POPULATE_WRITE) != 0:
                    return

    def wait(self) -> None:
        """Until every pool is backed."""
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        self._stop.set()
        self.wait()


def _tensors(model: nn.Module) -> list[tuple[list[tuple[object, str]], torch.Tensor]]:
    """(owners, tensor) for every distinct contiguous tensor of the model, each owner an
    (object, attribute) holding it: parameters, buffers and packed linear weights held as
    plain tensors (a tied weight once, with every holder: a tied LM head's buffer is the
    token embedding's), but not the dense weight of a layer packed in panels (the panels
    have a buffer of their own). oneDNN's packed float32 weights are its own opaque
    tensors, which stay in its memory."""
    found: dict[int, tuple[list[tuple[object, str]], torch.Tensor]] = {}
    for module in model.modules():
        slots = [(module, name, t) for name, t in
                 [*module._parameters.items(), *module._buffers.items()]]
        method = getattr(module, "method", None)  # a Linear's (kvserve.model.linear_method)
        if getattr(method, "packed_weight", None) is not None:
            slots.append((method, "packed_weight", method.packed_weight))
        for owner, name, t in slots:
            if (t is None or t.layout != torch.strided or t.device.type != "cpu"
                    or not t.is_contiguous() or t.numel() == 0):
                continue
            if name == "weight" and getattr(method, "panel_weight", None) is not None:
                continue  # the panels hold it; left out, it can be let go on its own
            found.setdefault(t.data_ptr(), ([], t))[0].append((owner, name))
    return list(found.values())


def aligned_size(n: int) -> int:
    """n bytes rounded up to where the next tensor of a HugePageBuffer may start."""
    return -(-n // ALIGN) * ALIGN


@torch.no_grad()  # not inference_mode: the moved parameters stay usable with autograd on
def move_to_huge_pages(model: nn.Module) -> int:
    """Copy the model's tensors into one huge-page buffer, in module order (the order a
    step reads them); returns the bytes moved (0 when they already were: a model shared
    by engines one after another). A tied weight stays tied: its Parameter object is
    the one moved."""
    tensors = _tensors(model)
    if not tensors or getattr(model, "_huge_page_buffer", None) is not None:
        return 0
    buffer = HugePageBuffer(sum(aligned_size(t.numel() * t.element_size()) for _, t in tensors))
    moved = 0
    while tensors:  # each old tensor let go once copied: peak memory is one tensor more
        owners, t = tensors.pop(0)
        copy = buffer.take(tuple(t.shape), t.dtype)
        copy.copy_(t)
        for owner, name in owners:
            if isinstance(owner, nn.Module) and name in owner._parameters:
                owner._parameters[name].data = copy
            elif isinstance(owner, nn.Module) and name in owner._buffers:
                owner._buffers[name] = copy
            else:
                setattr(owner, name, copy)
        moved += t.numel() * t.element_size()
    model._huge_page_buffer = buffer
    return moved

"""All-reduce, all-gather and broadcast through shared memory, for ranks on one machine.

gloo's all-reduce goes through loopback TCP: each of the two a layer makes costs far more
than the sum it computes. Ranks on one machine can instead each write their partial sum
to their own slot of a shared file in ``/dev/shm``, raise a counter, wait until every
other rank has raised its own, and add the slots up, in rank order (so every rank gets
the same bits). Two sets of slots alternate, so a rank may write the next sum while a
slower one still reads the last; before writing a set again a rank waits until every
other rank is done reading it. The waits spin: each rank has its own cores, and the
other ranks are a few microseconds behind; a wait longer than SPIN_S sleeps between
looks instead (a rank waiting for the next step of an idle engine does not burn its core).

The same slots carry an all-gather (each rank's piece side by side) and rank 0's
broadcast of bytes (the step's pickled inputs). Tensors larger than a slot are
all-reduced in slot-sized pieces. x86 keeps stores in order, so a counter seen raised
means its slot's data is there.
"""
from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from pathlib import Path

import numpy as np
import torch

SLOT_BYTES = 8 * 2**20  # per rank and buffer
SHM_DIR = Path("/dev/shm")
SPIN_S = 0.002          # then the waits sleep between looks
SLEEP_S = 0.0002


def shm_path() -> str:
    """A fresh file name for one group's shared memory."""
    return str(SHM_DIR / f"kvserve-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


class SharedMemoryGroup:
    """Collectives among ``size`` ranks over the file at ``path`` (rank 0 creates it
    before the others open it; :meth:`unlink` removes the name once all have). Every
    rank makes the same calls in the same order."""

    def __init__(self, path: str, rank: int, size: int, create: bool) -> None:
        self.path, self.rank, self.size = path, rank, size
        self.alive = None  # called while a wait sleeps: raises when it can never end
        header = 4096  # counters: written[size], read[size] (int64), one page
        total = header + 2 * size * SLOT_BYTES
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), total)
        counters = np.frombuffer(self._map, dtype=np.int64, count=2 * size)
        self.written, self.read = counters[:size], counters[size:]
        raw = torch.frombuffer(self._map, dtype=torch.uint8, offset=header,
                               count=2 * size * SLOT_BYTES)
        self.slots = raw.view(2, size, SLOT_BYTES)
        self.seq = 0
        self.others = [r for r in range(size) if r != rank]

    @staticmethod
    def usable(size: int) -> bool:
        """Shared memory can carry ``size`` ranks' collectives here: x86 (the counters
        rely on its store order) and room in /dev/shm (a sparse file that cannot be
        backed kills its writer with SIGBUS, not an error)."""
        if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
            return False
        try:
            stat = os.statvfs(SHM_DIR)
        except OSError:
            return False
        return stat.f_bavail * stat.f_frsize >= 2 * (4096 + 2 * size * SLOT_BYTES)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _wait(self, counters: np.ndarray, at_least: int, ranks: list[int] | None = None
              ) -> None:
        """Until ``counters[r] >= at_least`` for each of ``ranks`` (default: the others)."""
        spin_until = None
        for r in self.others if ranks is None else ranks:
            while counters[r] < at_least:
                now = time.perf_counter()
                if spin_until is None:
                    spin_until = now + SPIN_S
                elif now > spin_until:
                    if self.alive is not None:
                        self.alive()
                    time.sleep(SLEEP_S)
                else:  # a rank sharing this CPU gets to run
                    os.sched_yield()

    def _publish(self, data: torch.Tensor) -> tuple[int, int]:
        """Write this rank's bytes into its slot of the next buffer; (seq, buffer)."""
        self.seq += 1
        seq, buf = self.seq, self.seq % 2
        self._wait(self.read, seq - 2)  # everyone is done with this buffer's last use
        self.slots[buf, self.rank, :data.numel()].copy_(data)
        self.written[self.rank] = seq
        return seq, buf

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
        per_slot = SLOT_BYTES // flat.element_size()
        for start in range(0, flat.numel(), per_slot):
            self._reduce_piece(flat[start:start + per_slot])
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view(x.shape))
        return x

    def _reduce_piece(self, piece: torch.Tensor) -> None:
        n = piece.numel() * piece.element_size()
        seq, buf = self._publish(piece.view(torch.uint8) if piece.is_contiguous()
                                 else piece.contiguous().view(torch.uint8))
        self._wait(self.written, seq)
        piece.copy_(self.slots[buf, 0, :n].view(piece.dtype))
        for r in range(1, self.size):
            piece.add_(self.slots[buf, r, :n].view(piece.dtype))
        self.read[self.rank] = seq

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= SLOT_BYTES

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` (equal shapes, ``fits``) side by side along the last dim."""
        x = x.contiguous()
        n = x.numel() * x.element_size()
        seq, buf = self._publish(x.view(-1).view(torch.uint8))
        self._wait(self.written, seq)
        parts = [self.slots[buf, r, :n].view(x.dtype).view(x.shape) for r in range(self.size)]
        out = torch.cat(parts, dim=-1)
        self.read[self.rank] = seq
        return out

    def send(self, data: bytes) -> None:
        """Rank 0: ``data`` (at most SLOT_BYTES - 8) to every other rank."""
        payload = torch.frombuffer(bytearray(len(data).to_bytes(8, "little") + data),
                                   dtype=torch.uint8)
        seq, _ = self._publish(payload)
        self.read[self.rank] = seq  # rank 0 reads nothing back

    def receive(self) -> bytes:
        """A rank > 0: what rank 0 sent next (waits, sleeping once idle)."""
        self.seq += 1
        seq, buf = self.seq, self.seq % 2
        self._wait(self.written, seq, [0])
        slot = self.slots[buf, 0]
        size = int.from_bytes(bytes(slot[:8].numpy()), "little")
        data = bytes(slot[8:8 + size].numpy())
        self.written[self.rank] = seq  # keeps every rank's counters in step
        self.read[self.rank] = seq
        return data

    def close(self) -> None:
        self.written = self.read = self.slots = None
        try:
            self._map.close()
        except BufferError:  # a tensor view still alive: the mapping goes with the process
            pass

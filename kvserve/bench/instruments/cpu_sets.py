"""Which CPUs each benchmarked system was allowed and actually ran on.

A comparison means something only when both systems had the same cores: a peer started
from a process whose mask had been narrowed inherits the narrowed mask and runs its
threads on fewer cores. So every system's run is watched from outside: a sampler reads
``/proc/PID/task/*/stat`` of the process and its descendants while the run lasts and
notes, for each thread whose CPU time grew since the last look, the CPU it last ran on
and the CPUs it was allowed (its ``Cpus_allowed_list``: a bound compute thread has one);
each process's own mask and thread count come from ``/proc/PID/status``. :func:`check_same_cpus` refuses a comparison whose systems were
allowed, or ran on, different CPU sets.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from kvserve.config import parse_cpu_list

__all__ = ["ProcessCpus", "CpuUsage", "CpuSampler", "CpuSetMismatch", "check_same_cpus"]

SAMPLE_INTERVAL_S = 0.05
# a thread counts as one that ran when it used at least this share of the run's CPU
# time: a logging or tokenizer thread that woke once does not widen a system's CPU set
BUSY_SHARE = 0.05

# fields of /proc/PID/task/TID/stat after the command name, counted from 0 (proc(5)
# numbers them from 1 with pid and comm first: utime is field 14, processor 39)
_UTIME, _STIME, _PROCESSOR = 11, 12, 36


class CpuSetMismatch(RuntimeError):
    """Systems of one comparison ran on different CPUs: their figures do not compare."""


@dataclass
class ProcessCpus:
    pid: int
    command: str
    mask: list[int]             # the process's CPU mask (its main thread's)
    threads: int                # threads alive at the last look
    busy_threads: int = 0       # threads that used at least BUSY_SHARE of the CPU time
    allowed: list[int] = field(default_factory=list)  # the busy threads' masks, together
    ran_on: list[int] = field(default_factory=list)  # CPUs its busy threads were seen on
    cpu_s: float = 0.0          # CPU seconds its threads used while watched


@dataclass
class CpuUsage:
    """One system's run: each process of its tree, and the union of their CPUs."""

    processes: list[ProcessCpus]

    @property
    def allowed(self) -> list[int]:
        return sorted({c for p in self.processes for c in p.allowed})

    @property
    def ran_on(self) -> list[int]:
        return sorted({c for p in self.processes for c in p.ran_on})

    @property
    def busy_threads(self) -> int:
        return sum(p.busy_threads for p in self.processes)

    def to_dict(self) -> dict:
        return {"allowed": self.allowed, "ran_on": self.ran_on,
                "busy_threads": self.busy_threads,
                "processes": [vars(p) for p in self.processes]}


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the thread or process ended between the listing and the read
        return None


def _status_field(status: str, key: str) -> str:
    for line in status.splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (through each thread's ``children``)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            text = _read(task / "children")
            if text:
                todo.extend(int(c) for c in text.split())
    return seen


class CpuSampler:
    """Watches the process tree of ``pid`` (default: this process) while a ``with``
    block runs; :attr:`usage` holds what it saw. Entered again (a system's next round),
    it adds what it sees to what it saw before.

    ``threads``: watch only these thread ids of the root process (this process's compute
    threads, say, so that the sampler's own thread and the caller's are left out)."""

    def __init__(self, pid: int | None = None, threads: Iterable[int] | None = None,
                 interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.only = None if threads is None else set(threads)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._used: dict[tuple[int, int], int] = {}  # clock ticks while watched
        self._last_ticks: dict[tuple[int, int], int] = {}
        self._seen_on: dict[tuple[int, int], set[int]] = {}
        self._masks: dict[tuple[int, int], list[int]] = {}
        self._info: dict[int, tuple[str, list[int], int]] = {}
        self.usage: CpuUsage | None = None

    def _look(self, record: bool = True) -> None:
        for pid in _descendants(self.pid):
            status = _read(Path(f"/proc/{pid}/status"))
            if status is None:
                continue
            cmdline = (_read(Path(f"/proc/{pid}/cmdline")) or "").replace("\0", " ").strip()
            allowed = parse_cpu_list(_status_field(status, "Cpus_allowed_list"))
            try:
                tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
            except FileNotFoundError:  # it exited since
                continue
            self._info[pid] = (cmdline[:200], allowed, len(tids))
            for tid in tids:
                if pid == self.pid and self.only is not None and tid not in self.only:
                    continue
                stat = _read(Path(f"/proc/{pid}/task/{tid}/stat"))
                if stat is None:
                    continue
                fields = stat.rsplit(")", 1)[1].split()
                ticks = int(fields[_UTIME]) + int(fields[_STIME])
                key = (pid, tid)
                last = self._last_ticks.get(key, ticks)
                if record and ticks > last:  # it ran since the last look
                    self._seen_on.setdefault(key, set()).add(int(fields[_PROCESSOR]))
                    self._used[key] = self._used.get(key, 0) + ticks - last
                    thread_status = _read(Path(f"/proc/{pid}/task/{tid}/status"))
                    if thread_status is not None:
                        self._masks[key] = parse_cpu_list(
                            _status_field(thread_status, "Cpus_allowed_list"))
                self._last_ticks[key] = ticks

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._look()

    def __enter__(self) -> "CpuSampler":
        self._stop.clear()
        self._look(record=False)  # what ran before the block is not this run's
        self._thread = threading.Thread(target=self._loop, name="kvserve-cpu-sampler",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._look()
        self.usage = self._summary()

    def _summary(self) -> CpuUsage:
        tick = os.sysconf("SC_CLK_TCK")
        used = self._used
        total = sum(used.values())
        processes = []
        for pid, (command, mask, threads) in self._info.items():
            mine = [k for k in used if k[0] == pid]
            busy = [k for k in mine if total and used[k] >= BUSY_SHARE * total]
            processes.append(ProcessCpus(
                pid=pid, command=command, mask=mask, threads=threads,
                busy_threads=len(busy),
                allowed=sorted({c for k in busy for c in self._masks.get(k, mask)}),
                ran_on=sorted({c for k in busy for c in self._seen_on.get(k, ())}),
                cpu_s=sum(used[k] for k in mine) / tick))
        return CpuUsage(processes)


def check_same_cpus(systems: Mapping[str, CpuUsage | dict | None]) -> None:
    """Raise :class:`CpuSetMismatch` unless every system (name -> its usage, or its
    ``to_dict()``) was allowed the same CPUs and ran on the same CPUs; systems whose use
    was not watched (None) or that showed no busy thread are left out."""
    sets = {}
    for name, usage in systems.items():
        d = usage.to_dict() if isinstance(usage, CpuUsage) else usage
        if not d or not d["busy_threads"]:
            continue
        sets[name] = (tuple(d["allowed"]), tuple(d["ran_on"]))
    if len(set(sets.values())) > 1:
        lines = "; ".join(f"{n}: allowed {list(a)}, ran on {list(r)}"
                          for n, (a, r) in sets.items())
        raise CpuSetMismatch("the systems compared ran on different CPUs, so their figures "
                             f"do not compare ({lines}); run every system on the same cores")

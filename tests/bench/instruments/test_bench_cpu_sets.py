"""CPU sets of benchmarked systems, watched from /proc, and the refusal of mixed sets."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvserve.bench.instruments.cpu_sets import CpuSampler, CpuSetMismatch, CpuUsage, ProcessCpus, \
    check_same_cpus

SPIN = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"


def _usage(allowed, ran_on, busy=2):
    return CpuUsage([ProcessCpus(pid=1, command="x", mask=allowed, threads=busy,
                                 busy_threads=busy, allowed=allowed, ran_on=ran_on)])


def test_a_child_is_watched_with_its_own_mask():
    cpu = max(os.sched_getaffinity(0))
    proc = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c",
                             SPIN.format(s=1.0)])
    with CpuSampler(proc.pid) as sampler:
        proc.wait()
    usage = sampler.usage
    assert usage.allowed == [cpu] and usage.ran_on == [cpu]
    assert usage.busy_threads == 1 and usage.processes[0].cpu_s > 0.3


def test_a_process_tree_is_watched():
    """A runner that starts the real work in a child of its own (as vLLM's EngineCore)."""
    code = ("import subprocess, sys\n"
            f"subprocess.run([sys.executable, '-c', {SPIN.format(s=1.0)!r}])\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.3)  # the child is up
    with CpuSampler(proc.pid) as sampler:
        proc.wait()
    busy = [p for p in sampler.usage.processes if p.busy_threads]
    assert len(sampler.usage.processes) == 2 and len(busy) == 1 and busy[0].pid != proc.pid


def test_rounds_add_up_and_idle_time_is_not_counted():
    sampler, used = CpuSampler(), 0.0
    for _ in range(2):
        with sampler:
            start, t = time.process_time(), time.time()
            while time.time() - t < 0.4:
                pass
            used += time.process_time() - start
        spin = time.time()
        while time.time() - spin < 0.4:  # between rounds: not watched
            pass
    me = next(p for p in sampler.usage.processes if p.pid == os.getpid())
    assert abs(me.cpu_s - used) < 0.15, (me.cpu_s, used)
    assert sampler.usage.ran_on and set(sampler.usage.ran_on) <= os.sched_getaffinity(0)


def test_bound_threads_count_with_their_own_masks():
    """A peer whose busy threads are each bound to one CPU (vLLM's OpenMP binding) was
    allowed the CPUs of all of them, whatever its main thread's mask."""
    cpus = sorted(os.sched_getaffinity(0))
    code = ("import os, threading, time\n"
            "time.sleep(0.5)\n"  # started and idle before it is watched
            "def spin(cpu):\n"
            "    os.sched_setaffinity(0, {cpu})\n"
            "    t = time.time()\n"
            "    while time.time() - t < 1.0: pass\n"
            f"ts = [threading.Thread(target=spin, args=(c,)) for c in {cpus}]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.3)
    with CpuSampler(proc.pid) as sampler:
        proc.wait()
    assert sampler.usage.allowed == cpus and sampler.usage.ran_on == cpus
    assert sampler.usage.busy_threads == len(cpus)  # the spinning ones, not the main thread


def test_same_cpus_pass_and_different_ones_are_refused():
    check_same_cpus({"kvserve": _usage([0, 1], [0, 1]), "vllm": _usage([0, 1], [0, 1]).to_dict(),
                     "unwatched": None})
    with pytest.raises(CpuSetMismatch, match=r"llamacpp: allowed \[0\], ran on \[0\]"):
        check_same_cpus({"kvserve": _usage([0, 1], [0, 1]), "llamacpp": _usage([0], [0])})
    with pytest.raises(CpuSetMismatch, match="different CPUs"):  # same mask, one core used
        check_same_cpus({"kvserve": _usage([0, 1], [0, 1]), "peer": _usage([0, 1], [1])})


def test_a_process_that_exits_while_looked_at_is_left_out(monkeypatch):
    """Its status was read, then it was gone before its threads were listed."""
    from kvserve.bench.instruments import cpu_sets
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(cpu_sets, "_descendants", lambda pid: [pid])
    real = cpu_sets._read
    monkeypatch.setattr(cpu_sets, "_read", lambda path: "Cpus_allowed_list:\t0\n"
                        if path.name == "status" else real(path))
    sampler = CpuSampler(gone.pid)
    sampler._look()
    assert sampler._info == {}

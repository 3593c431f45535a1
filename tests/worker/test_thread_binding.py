"""Compute threads bound one to a CPU (``omp_threads_bind``), as vLLM's CPU worker."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvserve import LLM
from kvserve.config import parse_cpu_list
from kvserve.engine.engine_args import EngineArgs
from kvserve.kernels import load_kernels
from kvserve.worker import compute_thread
from kvserve.worker.compute_thread import THREAD_NAME
from kvserve.worker.platform import allowed_cpus, cpus_to_bind, one_cpu_per_core, \
    physical_cores

kernels = load_kernels()


@pytest.mark.parametrize("text, cpus", [("0", [0]), ("0-3", [0, 1, 2, 3]),
                                        ("0,2", [0, 2]), ("4-5, 1", [4, 5, 1])])
def test_cpu_lists_parse(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("bad", ["", "a", "1-", "3-1", "0,0", "0-2,1", "-1"])
def test_bad_cpu_lists_are_named(bad):
    with pytest.raises(ValueError, match="CPU"):
        parse_cpu_list(bad)
    with pytest.raises(ValueError, match="CPU"):
        EngineArgs(omp_threads_bind=bad)


def test_choice_of_cpus():
    cores = one_cpu_per_core()
    assert len(cores) == physical_cores()
    assert cpus_to_bind("auto", 1) == cores[:1]
    assert cpus_to_bind("auto", len(cores) + 1) is None  # more threads than cores: unbound
    assert cpus_to_bind("nobind", 1) is None
    assert cpus_to_bind(str(cores[0]), 1) == cores[:1]
    with pytest.raises(ValueError, match="one per thread"):
        cpus_to_bind(str(cores[0]), 2)
    with pytest.raises(ValueError, match="not available"):
        cpus_to_bind(str(max(os.sched_getaffinity(0)) + 1000), 1)


def _in_thread(fn):
    """Run fn in a fresh thread (its own OpenMP team and CPU mask); return its result."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            out["error"] = e
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


@pytest.mark.skipif(not kernels.available, reason="no native kernels")
def test_team_threads_are_bound():
    """The calling thread, thread 0 of its team, ends up on the CPU given for it."""
    cpu = one_cpu_per_core()[-1]

    def bind_one():
        torch.set_num_threads(1)
        failed = kernels.bind_threads([cpu])
        return failed, os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    try:
        assert _in_thread(bind_one) == (0, {cpu})
    finally:
        torch.set_num_threads(threads)


TEAM_SCRIPT = """
import json, os, sys, threading, torch
from kvserve.kernels import load_kernels
first, second = int(sys.argv[1]), int(sys.argv[2])
def on(cpu):
    return sum(os.sched_getaffinity(int(t)) == {cpu} for t in os.listdir("/proc/self/task"))
out = {}
def bind_two():
    torch.set_num_threads(2)
    out["failed"] = load_kernels().bind_threads([first, second])
    out["own"] = sorted(os.sched_getaffinity(0))
    out["on_second"] = on(second)
t = threading.Thread(target=bind_two); t.start(); t.join()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(not kernels.available or len(one_cpu_per_core()) < 2,
                    reason="needs native kernels and two cores")
def test_worker_threads_are_bound_too():
    """A team of two bound from a fresh thread: the thread itself on the first CPU, its
    worker thread on the second (a fresh process, so no earlier team is counted)."""
    first, second = one_cpu_per_core()[:2]
    out = subprocess.run([sys.executable, "-c", TEAM_SCRIPT, str(first), str(second)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    result = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
    assert result == {"failed": 0, "own": [first], "on_second": 1}


def _threads_of(pid: int) -> list[tuple[str, set[int]]]:
    """(name, CPU mask) of each thread of process ``pid``, from /proc."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out.append((fields["Name"].strip(), set(parse_cpu_list(fields["Cpus_allowed_list"]))))
    return out


def _bound_one_per_core(threads: list[tuple[str, set[int]]], count: int) -> None:
    """``count`` compute threads, each on a CPU of its own; every other thread unbound."""
    allowed = set(os.sched_getaffinity(0))
    bound = [mask for name, mask in threads if name == THREAD_NAME and len(mask) == 1]
    assert len(bound) == count and len(set.union(*bound)) == count, threads
    assert all(mask == allowed for name, mask in threads if name != THREAD_NAME), threads


CALLER_SCRIPT = """
import json, os, subprocess, sys, threading
from kvserve import LLM, SamplingParams
before = sorted(os.sched_getaffinity(0))
llm = LLM(sys.argv[1], num_threads=int(sys.argv[2]), gemm_warmup_rows=0)
llm.generate(["a b c"], SamplingParams(max_tokens=4), use_tqdm=False)
later = {}
t = threading.Thread(target=lambda: later.update(mask=sorted(os.sched_getaffinity(0))))
t.start(); t.join()
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True, check=True).stdout.strip()
print("RESULT " + json.dumps({"before": before, "after": sorted(os.sched_getaffinity(0)),
                              "later_thread": later["mask"], "child": json.loads(child),
                              "bound": llm.engine.worker.bound_cpus}))
input()  # the test reads this process's threads, then lets it end
"""


@pytest.mark.skipif(not kernels.available or len(one_cpu_per_core()) < 2,
                    reason="needs native kernels and two cores")
def test_llm_leaves_the_callers_cpus_alone(llama_dir):
    """After LLM(): the calling thread, a thread it starts and a child process keep the
    process's CPUs; the compute threads are bound one to a core (a fresh process, as a
    user's program would be)."""
    allowed = sorted(os.sched_getaffinity(0))
    threads = len(one_cpu_per_core())
    proc = subprocess.Popen([sys.executable, "-c", CALLER_SCRIPT, llama_dir, str(threads)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        line = next(l for l in proc.stdout if l.startswith("RESULT "))
        result = json.loads(line[len("RESULT "):])
        _bound_one_per_core(_threads_of(proc.pid), threads)
    finally:
        proc.communicate("\n", timeout=60)
    assert result["before"] == result["after"] == allowed
    assert result["later_thread"] == result["child"] == allowed
    assert result["bound"] == one_cpu_per_core()[:threads]


@pytest.mark.skipif(not kernels.available or len(one_cpu_per_core()) < 2,
                    reason="needs native kernels and two cores")
def test_server_leaves_its_main_thread_alone(llama_dir, tmp_path):
    """``kvserve serve``: once the engine is up, the server's own threads (its main
    thread, whose children its subprocesses would be) keep every CPU."""
    from tests.entrypoints.conftest import ServerProcess

    threads = len(one_cpu_per_core())
    server = ServerProcess(llama_dir, tmp_path / "server.log", "--num-threads", str(threads))
    try:
        server.wait_healthy()
        _bound_one_per_core(_threads_of(server.proc.pid), threads)  # main thread included
    finally:
        server.terminate()


def test_engine_binds_or_not(llama_dir):
    """"auto" binds the compute thread; "nobind" lets a team an earlier engine bound run
    anywhere again; neither touches the calling thread."""
    threads = torch.get_num_threads()
    mask = os.sched_getaffinity(0)

    def engine_cpus(setting):
        llm = LLM(llama_dir, num_threads=1, omp_threads_bind=setting, gemm_warmup_rows=0)
        return llm.engine.worker.bound_cpus, compute_thread().call(os.sched_getaffinity, 0)
    try:
        cpus, compute_mask = engine_cpus("auto")
        if kernels.available:
            assert cpus == one_cpu_per_core()[:1] and compute_mask == set(cpus)
        cpus, compute_mask = engine_cpus("nobind")
        assert cpus is None
        if kernels.available:
            assert compute_mask == set(allowed_cpus())
        assert os.sched_getaffinity(0) == mask
        # a bound thread's own mask does not shrink what later engines count as the machine
        assert physical_cores() == len(one_cpu_per_core())
    finally:
        torch.set_num_threads(threads)

"""Compute threads bound one to a CPU (``omp_threads_bind``), as vLLM's CPU worker."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from kvserve import LLM
from kvserve.config import EngineArgs, parse_cpu_list
from kvserve.kernels import load_kernels
from kvserve.worker.platform import cpus_to_bind, one_cpu_per_core, physical_cores

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


def _threads_on(cpu: int) -> int:
    """Threads of this process whose CPU mask is exactly {cpu}."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            count += os.sched_getaffinity(int(task)) == {cpu}
        except OSError:  # the thread ended meanwhile
            pass
    return count


@pytest.mark.skipif(not kernels.available or len(one_cpu_per_core()) < 2,
                    reason="needs native kernels and two cores")
def test_worker_threads_are_bound_too():
    first, second = one_cpu_per_core()[:2]
    before, threads = _threads_on(second), torch.get_num_threads()

    def bind_two():
        torch.set_num_threads(2)
        failed = kernels.bind_threads([first, second])
        return failed, os.sched_getaffinity(0), _threads_on(second)
    try:
        failed, own_mask, on_second = _in_thread(bind_two)
    finally:
        torch.set_num_threads(threads)
    assert failed == 0 and own_mask == {first}
    assert on_second == before + 1  # the new team's worker thread


def test_engine_binds_or_not(llama_dir):
    threads = torch.get_num_threads()

    def engine_cpus(setting):
        llm = LLM(llama_dir, num_threads=1, omp_threads_bind=setting, gemm_warmup_rows=0)
        return llm.engine.worker.bound_cpus, os.sched_getaffinity(0)
    try:
        cpus, mask = _in_thread(lambda: engine_cpus("auto"))
        if kernels.available:
            assert cpus == one_cpu_per_core()[:1] and mask == set(cpus)
        assert _in_thread(lambda: engine_cpus("nobind"))[0] is None
        # a bound thread's own mask does not shrink what later engines count as the machine
        assert physical_cores() == len(one_cpu_per_core())
    finally:
        torch.set_num_threads(threads)

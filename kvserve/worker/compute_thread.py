"""The one thread kvserve computes on in its process, and the worker that sends it calls.

Why a thread of its own: the compute threads are bound one to a CPU (see
:meth:`CPUWorker._bind_compute_threads`), and binding an OpenMP team binds the thread that
starts its parallel regions. Were that the caller's thread, the caller, every thread it
starts later and every child process it spawns would inherit a one-CPU mask. So every
worker call that computes (the model's load included) runs here; this thread and its
team are bound, the caller's threads keep the mask the process started with.

Why one for the process, not one per engine: libgomp keeps a team of worker threads per
thread that starts parallel regions, and once the teams hold more threads than there are
cores it stops letting idle workers spin between regions, which made decode steps much
slower. Engines built in one process (a bench's variants, the tuner's candidates) share
this thread and so one team, and their calls run in the order they come.

Async scheduling submits a step and makes the previous step's outputs while it runs.
Invariant: at most one step of an engine is submitted at a time; the engine reads its
result before it schedules again, so the KV manager never hands out a block while a step
that may write it still runs. The thread is a daemon: a step that never returns does
not keep the process from exiting. Reading a worker's statistics does not wait for a step.
"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch

from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.worker.step_profiler import StepTimeStats
from kvserve.worker.worker_base import DraftAsk, DraftModelInfo, DraftProposal, \
    KernelBuild, KVCacheLayout, ModelRunnerOutput, TransferStats, Worker

THREAD_NAME = "kvserve-compute"
PR_SET_NAME = 15  # prctl(2)


class ComputeThread:
    """One daemon thread running submitted calls in order."""

    def __init__(self, name: str = THREAD_NAME) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Queue ``fn(*args, **kwargs)``; it runs in the caller's autograd mode (inference
        mode and grad mode are per thread: a caller's ``torch.inference_mode()`` holds
        for the call it sends here)."""
        future: Future = Future()
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        self._jobs.put((future, fn, args, kwargs, modes))
        return future

    def call(self, fn: Callable, *args, **kwargs) -> Any:
        """Run ``fn`` on this thread and return what it returns (or raise what it raised);
        called from this thread itself, it runs at once (a call that computes may make
        another)."""
        if threading.current_thread() is self.thread:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def _run(self) -> None:
        _name_native_thread(self.thread.name)
        while True:
            future, fn, args, kwargs, (inference, grad) = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                        future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - the caller's to handle
                    future.set_exception(e)


def _name_native_thread(name: str) -> None:
    """The thread's name as ``top -H`` and ``/proc/PID/task/TID/comm`` show it (Linux;
    at most 15 bytes)."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name stays Python's only
        pass


_shared: ComputeThread | None = None
_shared_lock = threading.Lock()


def compute_thread() -> ComputeThread:
    """The process's compute thread, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ComputeThread()
        return _shared


def _forget_after_fork() -> None:
    """A forked child has no copy of the thread: the next use starts one of its own."""
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


class ComputeThreadWorker(Worker):
    def __init__(self, make: Callable[[], Worker]) -> None:
        """``make`` builds the worker; it runs on the compute thread."""
        self._thread = compute_thread()
        self.inner = self._thread.call(make)

    def submit(self, out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start the step; its future gives its output or raises what the step raised."""
        return self._thread.submit(self.inner.execute_model, out)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self._thread.call(self.inner.execute_model, out)

    def determine_kv_cache_layout(self) -> KVCacheLayout:
        return self._thread.call(self.inner.determine_kv_cache_layout)

    def initialize_kv_cache(self, layout: KVCacheLayout) -> None:
        self._thread.call(self.inner.initialize_kv_cache, layout)

    def warm_up(self) -> None:
        self._thread.call(self.inner.warm_up)

    def finish_startup(self) -> None:
        self._thread.call(self.inner.finish_startup)

    def settle(self) -> None:
        self.inner.settle()  # a wait, not a computation: the compute thread stays free

    def time_step_rows(self, row_counts: list[int]) -> dict[int, float]:
        return self._thread.call(self.inner.time_step_rows, row_counts)

    def load_draft_model(self, model_dir: str) -> DraftModelInfo:
        return self._thread.call(self.inner.load_draft_model, model_dir)

    def time_draft_model(self, batch_sizes: list[int], chunk_lengths: list[int]
                         ) -> tuple[dict[int, float], dict[int, float]]:
        return self._thread.call(self.inner.time_draft_model, batch_sizes, chunk_lengths)

    def propose_drafts(self, asks: list[DraftAsk]) -> DraftProposal:
        return self._thread.call(self.inner.propose_drafts, asks)

    def forget_drafts(self, request_ids: list[str]) -> None:
        self._thread.call(self.inner.forget_drafts, request_ids)

    def remove_lora(self, lora_int_id: int) -> None:
        self._thread.call(self.inner.remove_lora, lora_int_id)

    def kernel_build(self) -> KernelBuild:
        return self.inner.kernel_build()

    def transfer_stats(self) -> TransferStats:
        return self.inner.transfer_stats()

    def tuning_plan(self):
        return self.inner.tuning_plan()

    def step_time_stats(self) -> StepTimeStats:
        return self.inner.step_time_stats()

    def close(self) -> None:
        self._thread.call(self.inner.close)

    def __getattr__(self, name: str):
        """The wrapped worker's own attributes (its runner, profiler), for benches."""
        if name == "inner":  # not set yet: the constructor failed
            raise AttributeError(name)
        return getattr(self.inner, name)

"""A worker that computes on a thread of its own, for async scheduling.

Async scheduling has the engine's thread turn one step's tokens into text and outputs
while the model computes the next, so the model needs another thread. Every call that
computes (the model's load included) runs on that one thread: libgomp keeps a team of
worker threads per thread that starts parallel regions, and two teams on the same
cores stop spinning between regions (see :mod:`kvserve.engine.async_engine`). Reading
the worker's statistics does not wait for a step.

Invariant: at most one step is submitted at a time; the engine reads its result before
it schedules again, so the KV manager never hands out a block while a step that may
write it still runs. The thread is a daemon, as the engine's is: a step that never
returns does not keep the process from exiting.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable

from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.worker.step_profiler import StepTimeStats
from kvserve.worker.worker_base import KVCacheLayout, ModelRunnerOutput, TransferStats, Worker


class _DaemonThread:
    """One daemon thread running submitted calls in order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - the caller's to handle
                    future.set_exception(e)


class ModelThreadWorker(Worker):
    def __init__(self, make: Callable[[], Worker]) -> None:
        """``make`` builds the worker; it runs on the model thread."""
        self._thread = _DaemonThread("kvserve-model")
        try:
            self.inner = self._call(make)
        except BaseException:
            self._thread.shutdown()
            raise

    def _call(self, fn, *args):
        return self._thread.submit(fn, *args).result()

    def submit(self, out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start the step; its future gives its output or raises what the step raised."""
        return self._thread.submit(self.inner.execute_model, out)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(out).result()

    def determine_kv_cache_layout(self) -> KVCacheLayout:
        return self._call(self.inner.determine_kv_cache_layout)

    def initialize_kv_cache(self, layout: KVCacheLayout) -> None:
        self._call(self.inner.initialize_kv_cache, layout)

    def warm_up(self) -> None:
        self._call(self.inner.warm_up)

    def finish_startup(self) -> None:
        self._call(self.inner.finish_startup)

    def time_step_rows(self, row_counts: list[int]) -> dict[int, float]:
        return self._call(self.inner.time_step_rows, row_counts)

    def transfer_stats(self) -> TransferStats:
        return self.inner.transfer_stats()

    def step_time_stats(self) -> StepTimeStats:
        return self.inner.step_time_stats()

    def close(self) -> None:
        try:
            self._call(self.inner.close)
        finally:
            self._thread.shutdown()

    def __getattr__(self, name: str):
        """The wrapped worker's own attributes (its runner, profiler), for benches."""
        if name == "inner":  # not set yet: the constructor failed
            raise AttributeError(name)
        return getattr(self.inner, name)

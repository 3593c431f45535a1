"""TensorParallelWorker: one CPU worker per tensor-parallel rank, behind :class:`Worker`.

Rank 0 runs in the engine's process; ranks 1..N-1 are fresh interpreters
(``python -m kvserve.worker.parallel.tensor_parallel_worker``, their settings pickled on stdin:
unlike multiprocessing's spawn, nothing re-imports the caller's main script). They meet
through a TCP store and a gloo process group on loopback (their own group: no
torch.distributed global state, so engines come and go within one process). Every call
that runs the model — warm-up, the step cost measurement, each step — is sent to all
ranks by broadcast (pickled: the method's name and its arguments) and run by each on
its share of the model; the layers' all-reduces and the logits' all-gather meet inside.
Every rank samples from the same gathered logits; rank 0's tokens are the step's. The
scheduler, the KV manager and a draft model run on rank 0 alone.

A rank that exits, or a collective that fails, raises :class:`WorkerDiedError` from
the step: the engine stops (its server answers 503 and exits non-zero) instead of
waiting on a rank that will never answer.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import subprocess
import sys
import time

import torch

from kvserve.config.engine import EngineConfig
from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.logger import init_logger
from kvserve.model.tensor_parallel import TensorParallelGroup
from kvserve.worker.parallel.shm_collectives import SLOT_BYTES, SharedMemoryGroup, shm_path
from kvserve.worker.worker_base import DraftAsk, DraftModelInfo, DraftProposal, \
    KernelBuild, KVCacheLayout, ModelRunnerOutput, TransferStats, Worker, \
    WorkerDiedError

logger = init_logger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)  # start-up warm-up included
LOOPBACK = "127.0.0.1"


def _process_group(store, rank: int, size: int):
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    options._timeout = COLLECTIVE_TIMEOUT
    return ProcessGroupGloo(store, rank, size, options)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config a rank's worker runs under: its share of the threads and CPUs."""
    from kvserve.worker.platform import one_cpu_per_core, physical_cores

    size = config.parallel.tensor_parallel_size
    worker = config.worker
    bind = worker.omp_threads_bind
    if "|" in bind:  # one CPU list per rank, as VLLM_CPU_OMP_THREADS_BIND
        bind = bind.split("|")[rank]
        threads = worker.num_threads or len(_cpu_list(bind))
    else:
        threads = worker.num_threads or max(1, physical_cores() // size)
        if bind == "auto":
            cpus = one_cpu_per_core()[rank * threads:(rank + 1) * threads]
            bind = ",".join(map(str, cpus)) if len(cpus) == threads else "nobind"
    return dataclasses.replace(config, worker=dataclasses.replace(
        worker, num_threads=threads, omp_threads_bind=bind))


def _cpu_list(text: str) -> list[int]:
    from kvserve.config.validate import parse_cpu_list
    return parse_cpu_list(text)


class _Channel:
    """Rank 0's commands to the other ranks, pickled: through shared memory, or (too
    large for its slot) a length and the bytes by gloo broadcast."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        self.group, self.shm = tp.group, tp.shm
        self.seconds = 0.0  # rank 0's time sending, cumulative

    def send(self, message) -> None:
        start = time.perf_counter()
        data = pickle.dumps(message)
        large = self.shm is None or len(data) + 9 > SLOT_BYTES
        if self.shm is not None:
            self.shm.send(b"\x01" if large else b"\x00" + data)
        if large:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.group.broadcast(torch.tensor([payload.numel()]), 0).wait()
            self.group.broadcast(payload, 0).wait()
        self.seconds += time.perf_counter() - start

    def receive(self):
        data = self.shm.receive() if self.shm is not None else b"\x01"
        if data[:1] == b"\x00":
            return pickle.loads(data[1:])
        size = torch.zeros(1, dtype=torch.int64)
        self.group.broadcast(size, 0).wait()
        payload = torch.empty(int(size), dtype=torch.uint8)
        self.group.broadcast(payload, 0).wait()
        return pickle.loads(payload.numpy().tobytes())


def run_rank(config: EngineConfig, rank: int, port: int, cpus: list[int], shm: str | None
             ) -> None:
    """A rank > 0 (``config``: its own, from :func:`rank_config`): join the group, load
    this rank's share, run what rank 0 sends. ``cpus``: the CPUs the engine's process
    may use (a process starts with the mask of the thread that spawned it, which an
    earlier engine's thread binding may have narrowed); ``shm``: the shared-memory
    collectives' file (None: gloo alone)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    from torch.distributed import TCPStore

    from kvserve.worker.cpu_worker import CPUWorker

    size = config.parallel.tensor_parallel_size
    shared = SharedMemoryGroup(shm, rank, size, create=False) if shm else None
    parent = os.getppid()

    def rank0_alive() -> None:
        if os.getppid() != parent:  # rank 0's process is gone: this one was re-parented
            raise RuntimeError("the engine process exited")
    if shared is not None:
        shared.alive = rank0_alive
    store = TCPStore(LOOPBACK, port, size, False, timeout=COLLECTIVE_TIMEOUT)
    group = _process_group(store, rank, size)
    tp = TensorParallelGroup(rank, size, group, shared)
    worker = CPUWorker(config, tp=tp)
    channel = _Channel(tp)
    while True:
        try:
            method, args = channel.receive()
        except RuntimeError as e:  # rank 0 is gone: nothing will ever be asked again
            logger.error("tensor-parallel rank %d: lost rank 0 (%s); exiting", rank,
                         str(e).splitlines()[0][:200])
            sys.exit(1)
        if method == "close":
            worker.close()
            return
        getattr(worker, method)(*args)  # a failure ends this rank: rank 0 sees it exit


class TensorParallelWorker(Worker):
    def __init__(self, config: EngineConfig) -> None:
        from torch.distributed import TCPStore

        from kvserve.worker.cpu_worker import CPUWorker
        from kvserve.worker.platform import allowed_cpus

        size = config.parallel.tensor_parallel_size
        start = time.perf_counter()
        store = TCPStore(LOOPBACK, 0, size, True, timeout=COLLECTIVE_TIMEOUT,
                         wait_for_workers=False)
        shared = (SharedMemoryGroup(shm_path(), 0, size, create=True)
                  if SharedMemoryGroup.usable(size) else None)
        self.ranks, self.closed, self.broken = [], False, False
        try:
            for r in range(1, size):
                proc = subprocess.Popen([sys.executable, "-m", __name__],
                                        stdin=subprocess.PIPE)
                proc.stdin.write(pickle.dumps((rank_config(config, r), r, store.port,
                                               allowed_cpus(), shared and shared.path)))
                proc.stdin.close()
                self.ranks.append(proc)
            self.store = store
            try:
                group = self._guard(lambda: _process_group(store, 0, size))
            finally:  # every rank has it open once the group is up (or none ever will)
                if shared is not None:
                    shared.unlink()
                    shared.alive = self._check_ranks
            self.tp = TensorParallelGroup(0, size, group, shared)
            self.channel = _Channel(self.tp)
            self.local = CPUWorker(rank_config(config, 0), tp=self.tp)
        except BaseException:  # no rank outlives a start-up that failed
            self._kill_ranks()
            raise
        logger.info("tensor parallel: %d ranks on gloo over loopback, ready in %.1fs "
                    "(rank 0 pid %d, others %s)", size, time.perf_counter() - start,
                    os.getpid(), [p.pid for p in self.ranks])

    # -- rank health -----------------------------------------------------------------------

    def _dead_rank(self) -> str | None:
        for r, p in enumerate(self.ranks, start=1):
            if p.poll() is not None:
                return f"tensor-parallel rank {r} exited with code {p.returncode}"
        return None

    def _check_ranks(self) -> None:
        dead = self._dead_rank()
        if dead:
            raise WorkerDiedError(dead)

    def _guard(self, fn):
        self._check_ranks()
        try:
            return fn()
        except RuntimeError as e:  # a collective with a rank that is gone
            raise WorkerDiedError(self._dead_rank() or f"tensor-parallel collective "
                                  f"failed: {e}") from e

    def _everywhere(self, method: str, *args, remote_args: tuple | None = None):
        """``method`` on every rank (the others get ``remote_args`` where given). Once
        sent, any failure on rank 0 is fatal: the other ranks would wait in a collective
        that rank 0 never reaches, and its next call would meet them out of step."""
        def run():
            self.channel.send((method, args if remote_args is None else remote_args))
            try:
                return getattr(self.local, method)(*args)
            except WorkerDiedError:
                raise
            except Exception as e:
                self.broken = True  # the ranks are out of step: only killing ends them
                raise WorkerDiedError(f"tensor-parallel rank 0 failed in {method}: "
                                      f"{type(e).__name__}: {e}") from e
        return self._guard(run)

    # -- the Worker interface --------------------------------------------------------------

    @property
    def runner(self):
        """Rank 0's model runner (its share of the model and of the KV pool)."""
        return self.local.runner

    def determine_kv_cache_layout(self) -> KVCacheLayout:
        return self.local.determine_kv_cache_layout()  # every rank's share is the same

    def initialize_kv_cache(self, layout: KVCacheLayout) -> None:
        self._everywhere("initialize_kv_cache", layout)

    def warm_up(self) -> None:
        self._everywhere("warm_up")

    def finish_startup(self) -> None:
        self._everywhere("finish_startup")

    def settle(self) -> None:
        self._everywhere("settle")

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # grammar masks only shape rank 0's sampling (the others' tokens are dropped)
        remote = dataclasses.replace(out, token_masks={}) if out.token_masks else out
        return self._everywhere("execute_model", out, remote_args=(remote,))

    def time_step_rows(self, row_counts: list[int]) -> dict[int, float]:
        return self._everywhere("time_step_rows", row_counts)

    # the draft model runs unsharded on rank 0 alone: the other ranks wait for the step

    def load_draft_model(self, model_dir: str) -> DraftModelInfo:
        return self.local.load_draft_model(model_dir)

    def time_draft_model(self, batch_sizes: list[int], chunk_lengths: list[int]
                         ) -> tuple[dict[int, float], dict[int, float]]:
        return self.local.time_draft_model(batch_sizes, chunk_lengths)

    def propose_drafts(self, asks: list[DraftAsk]) -> DraftProposal:
        return self.local.propose_drafts(asks)

    def forget_drafts(self, request_ids: list[str]) -> None:
        self.local.forget_drafts(request_ids)

    def tuning_plan(self):
        return self.local.tuning_plan()  # rank 0's (each rank keeps its own)

    def kernel_build(self) -> KernelBuild:
        return self.local.kernel_build()  # every rank builds on this machine, from one cache

    def transfer_stats(self) -> TransferStats:
        return self.local.transfer_stats()

    def step_time_stats(self):
        return self.local.step_time_stats()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        grace = 0.0
        if self._dead_rank() is None and not self.broken:
            try:
                self.channel.send(("close", ()))
                grace = 10.0
            except RuntimeError:
                pass
        self.local.close()
        self._kill_ranks(grace)

    def _kill_ranks(self, grace_s: float = 0.0) -> None:
        for p in self.ranks:
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":  # a rank > 0, started by TensorParallelWorker
    run_rank(*pickle.loads(sys.stdin.buffer.read()))

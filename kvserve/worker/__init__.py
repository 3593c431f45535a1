"""Workers: what runs the model on a platform, behind :class:`Worker`."""
from __future__ import annotations

from kvserve.config.engine import EngineConfig
from kvserve.worker.compute_thread import ComputeThreadWorker, compute_thread
from kvserve.worker.worker_base import KernelBuild, KVCacheLayout, TransferStats, Worker, \
    WorkerDiedError


def create_worker(config: EngineConfig, model=None) -> Worker:
    """The worker for this machine: the GPU worker (``device`` cuda), the CPU worker, or
    one per rank behind a TensorParallelWorker, computing on kvserve's own thread (:mod:`compute_thread`: the
    caller's threads keep their CPU mask). ``model``: weights already loaded for
    ``config.model`` (the tuner builds many engines over one; one process only)."""
    return ComputeThreadWorker(lambda: _create(config, model))


def _create(config: EngineConfig, model) -> Worker:
    if config.worker.device == "cuda":
        from kvserve.worker.gpu_worker import CUDAWorker
        return CUDAWorker(config, model)
    if config.parallel.tensor_parallel_size > 1:
        if model is not None:
            raise ValueError("preloaded weights cannot be split across tensor-parallel ranks")
        from kvserve.worker.parallel.tensor_parallel_worker import TensorParallelWorker
        return TensorParallelWorker(config)
    from kvserve.worker.cpu_worker import CPUWorker

    return CPUWorker(config, model)


__all__ = ["Worker", "KernelBuild", "KVCacheLayout", "TransferStats", "WorkerDiedError",
           "compute_thread", "create_worker"]

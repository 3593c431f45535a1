"""Workers: what runs the model on a platform, behind :class:`Worker`."""
from __future__ import annotations

from kvserve.config.engine import EngineConfig
from kvserve.worker.worker_base import KVCacheLayout, TransferStats, Worker


def create_worker(config: EngineConfig, model=None) -> Worker:
    """The worker for this machine (the CPU worker is the only one today). ``model``:
    weights already loaded for ``config.model`` (the tuner builds many engines over one)."""
    from kvserve.worker.cpu_worker import CPUWorker

    return CPUWorker(config, model)


__all__ = ["Worker", "KVCacheLayout", "TransferStats", "create_worker"]

"""EngineConfig: the validated parts, one per component.

The engine hands each component only its part: the scheduler gets ``scheduler``, the
KV manager ``cache``; the worker, which builds the model and its KV pool, reads
``model``, ``cache`` and ``worker``. New capabilities add a part here (parallel,
speculative decoding, structured outputs) rather than fields to an existing one.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.cache import CacheConfig
from kvserve.config.model import ModelConfig
from kvserve.config.scheduler import SchedulerConfig
from kvserve.config.worker import WorkerConfig


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    worker: WorkerConfig

    @property
    def warmup_tokens(self) -> int:
        """Prompt tokens of the dummy start-up step: a full step, within the model."""
        return min(self.scheduler.max_num_batched_tokens, self.model.max_model_len - 1)

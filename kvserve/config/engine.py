"""EngineConfig: the validated parts, one per component.

The engine hands each component only its part: the scheduler gets ``scheduler``, the
KV manager ``cache``; the worker, which builds the model and its KV pool, reads
``model``, ``cache`` and ``worker``. New capabilities add a part here (parallel,
speculative decoding, structured outputs) rather than fields to an existing one.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.cache import CacheConfig
from kvserve.config.lora import LoRAConfig
from kvserve.config.model import ModelConfig
from kvserve.config.parallel import ParallelConfig
from kvserve.config.scheduler import SchedulerConfig
from kvserve.config.speculative import SpeculativeConfig
from kvserve.config.worker import WorkerConfig


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    worker: WorkerConfig
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = ParallelConfig()
    lora: LoRAConfig | None = None  # None: no adapters served

    def __post_init__(self) -> None:
        """The rules across parts that need no implementation; those that do (the model
        split over the ranks, the KV manager's truncate, the draft model) are checked
        where the engine config is created (:mod:`kvserve.engine.engine_args`)."""
        size = self.parallel.tensor_parallel_size
        bind = self.worker.omp_threads_bind
        if "|" in bind and bind.count("|") + 1 != size:
            raise ValueError(f"omp_threads_bind {bind!r} gives {bind.count('|') + 1} CPU lists "
                             f"(split by '|'), one per rank: tensor_parallel_size is {size}")
        if size > 1 and self.worker.panel_gemm_max_rows:
            raise ValueError("panel_gemm_max_rows applies to one process: with "
                             f"tensor_parallel_size {size} the ranks run oneDNN's GEMMs "
                             "(leave it unset, or 0)")
        if self.lora is not None and size > 1:
            raise ValueError("enable_lora runs in one process: with tensor_parallel_size "
                             f"{size} adapters are not served (use one rank)")
        if self.speculative is not None and self.scheduler.async_scheduling:
            raise ValueError("async_scheduling does not run with speculative decoding (a "
                             "step's drafts are proposed from the tokens of the step before "
                             "it): turn one of them off")

    @property
    def warmup_tokens(self) -> int:
        """Prompt tokens of the dummy start-up step: a full step, within the model."""
        return min(self.scheduler.max_num_batched_tokens, self.model.max_model_len - 1)

"""ParallelConfig: how many processes share one model (tensor parallelism)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.validate import positive_int

MAX_TENSOR_PARALLEL_SIZE = 64


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks, one worker process each (rank 0: the engine's)

    def __post_init__(self) -> None:
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(f"tensor_parallel_size must be at most "
                             f"{MAX_TENSOR_PARALLEL_SIZE}, got {self.tensor_parallel_size}")

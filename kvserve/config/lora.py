"""LoRAConfig: serving LoRA adapters beside the base model (vLLM's names).

``max_loras``: adapters one step may run (the worker keeps that many slots, each
sized for ``max_lora_rank``); ``max_cpu_loras``: adapters kept read in memory, least
recently used let go first (at least ``max_loras``). Both count in the memory the KV
pool is sized from.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_LORAS = 256  # slots one native call serves (kernels/lora.c)
MAX_LORA_RANK = 512  # slices x rank of one layer must fit the native kernel's row


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or not 1 <= self.max_loras <= MAX_LORAS:
            raise ValueError(f"max_loras must be an integer in [1, {MAX_LORAS}], got "
                             f"{self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be an integer in [1, {MAX_LORA_RANK}], got "
                             f"{self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least "
                             f"max_loras ({self.max_loras})")

    @property
    def cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

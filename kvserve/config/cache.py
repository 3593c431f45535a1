"""CacheConfig: the KV memory design, its size and its slower tiers."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.validate import choice, number, optional_positive_int, parse_size, \
    positive_int

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "auto"          # auto: the compute dtype
    kv_cache_memory: int | str | None = None  # None: sized by the worker from free memory
    num_kv_blocks: int | None = None      # overrides kv_cache_memory
    kv_manager: str = "paged"             # a name in kvserve.core.kv.KV_MANAGERS
    memory_pool_ratio: float = 1.0        # buddy: share of the blocks in the buddy pool
    enable_prefix_caching: bool = True
    swap_space: float = 4.0               # GiB of host memory for swapped-out blocks
    kv_offload_dir: str | None = None     # the disk tier's directory
    kv_offload_size: int | str = "4GiB"
    warmup_prompts: str | None = None     # prompts whose KV is pinned at start
    swap_enabled: bool = False            # preemption_mode swap (SchedulerConfig's)
    # keep every layer's KV for the whole sequence, even where a layer's window reads less
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        positive_int("block_size", self.block_size)
        choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        optional_positive_int("num_kv_blocks", self.num_kv_blocks)
        number("memory_pool_ratio", self.memory_pool_ratio, low=0.0, high=1.0, low_open=True)
        number("swap_space", self.swap_space, low=0.0)
        parse_size(self.kv_offload_size)
        tiered = self.swap_enabled or self.kv_offload_dir or self.warmup_prompts
        if tiered and self.kv_manager != "paged":
            raise ValueError("preemption_mode swap, kv_offload_dir and warmup_prompts need "
                             f"kv_manager 'paged', got {self.kv_manager!r}")
        if (self.kv_offload_dir or self.warmup_prompts) and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir and warmup_prompts work through the prefix cache: "
                             "enable_prefix_caching must be on")

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * 2**30) if self.swap_enabled else 0

    @property
    def disk_tier_bytes(self) -> int:
        return parse_size(self.kv_offload_size) if self.kv_offload_dir else 0

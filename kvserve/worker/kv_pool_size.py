"""How many KV blocks the pool holds, and the swap and disk tiers' slots.

The count comes from the first setting given: ``num_kv_blocks``, then
``kv_cache_memory``; otherwise a share of the RAM available, capped, and never more
than ``max_num_seqs`` requests of ``max_model_len`` tokens can use. Under tensor
parallelism every memory figure is the whole engine's, each rank holding its share of
every block.
"""
from __future__ import annotations

import torch

from kvserve.config.engine import EngineConfig
from kvserve.config.validate import parse_size
from kvserve.logger import init_logger
from kvserve.model.config import ArchConfig
from kvserve.core.kv.groups import engine_kv_groups
from kvserve.worker.model_runner import kv_bytes_per_block
from kvserve.worker.platform import available_memory_bytes
from kvserve.worker.worker_base import KVCacheLayout

logger = init_logger(__name__)

DEFAULT_KV_SHARE = 0.4  # of available RAM: the rest is headroom for weights and activations
DEFAULT_KV_CAP = 4 * 2**30  # as vLLM's CPU backend: more is rarely used, and zeroing costs


def kv_cache_layout(config: EngineConfig, arch: ArchConfig, kv_dtype: torch.dtype,
                    ranks: int = 1, reserved: int = 0) -> KVCacheLayout:
    """``arch``: this rank's share of the model; ``ranks``: the tensor-parallel size;
    ``reserved``: bytes other users of memory the default size leaves room for (LoRA
    adapters)."""
    cache = config.cache
    groups = engine_kv_groups(config)
    per_block = kv_bytes_per_block(arch, cache.block_size, kv_dtype, groups)
    dtype_name = str(kv_dtype).removeprefix("torch.")
    num = _num_blocks(config, per_block, dtype_name, ranks,
                      groups.num_groups if groups is not None else 1, reserved)
    swap = cache.swap_space_bytes // per_block
    disk = cache.disk_tier_bytes // per_block
    if cache.swap_enabled and swap < 1:
        raise ValueError(f"swap_space {cache.swap_space} GiB holds no KV block "
                         f"({per_block} bytes); raise it or use preemption_mode recompute")
    if cache.kv_offload_dir and disk < 1:
        raise ValueError(f"kv_offload_size {cache.kv_offload_size} holds no KV block "
                         f"({per_block} bytes)")
    for name, slots in (("swap space", swap), ("disk tier", disk)):
        if slots:
            logger.info("%s: %d blocks (%.1f MiB)", name, slots, slots * per_block / 2**20)
    return KVCacheLayout(num, cache.block_size, per_block, dtype_name, swap, disk)


def _num_blocks(config: EngineConfig, per_block: int, dtype_name: str, ranks: int,
                num_groups: int = 1, reserved: int = 0) -> int:
    """``per_block``: this rank's bytes of a block; ``num_groups``: the KV groups each
    request holds a table in (at most a table's blocks each); ``reserved``: taken from
    the default share first."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        num, source = cache.num_kv_blocks, "num_kv_blocks"
    elif cache.kv_cache_memory is not None:
        num = parse_size(cache.kv_cache_memory) // (per_block * ranks)
        source = f"kv_cache_memory={cache.kv_cache_memory}"
        if num < 1:
            raise ValueError(f"kv_cache_memory {cache.kv_cache_memory} is smaller than one "
                             f"KV block ({per_block} bytes)")
    else:
        share = int(min(available_memory_bytes() * DEFAULT_KV_SHARE, DEFAULT_KV_CAP)) - reserved
        max_len = config.model.max_model_len
        useful = config.scheduler.max_num_seqs * -(-max_len // cache.block_size) * num_groups
        num = max(1, min(share // (per_block * ranks), useful))
        source = (f"default: min({DEFAULT_KV_SHARE:.0%} of available RAM, "
                  f"{DEFAULT_KV_CAP / 2**30:g} GiB, max_num_seqs x max_model_len)"
                  + (f" less {reserved / 2**20:.1f} MiB for LoRA adapters" if reserved else ""))
    logger.info("KV cache: %d blocks x %d tokens = %.1f MiB of %s%s (%s)", num,
                cache.block_size, num * per_block / 2**20, dtype_name,
                f" on each of {ranks} ranks" if ranks > 1 else "", source)
    return num

"""CUDAWorker: runs the model on one GPU (``--device cuda``).

The same model code, scheduler, KV managers, sampler and model runner as the CPU worker;
what differs is here:

- the weights are read straight into device memory, in bfloat16 by default (``dtype``
  auto: float16 for a float16 checkpoint);
- every layer runs torch's device kernels (no oneDNN packing, no native C kernels), and
  attention and the KV writer are the Triton kernels of ``kernels/triton_attention.py``
  over the same pool layout and block tables (``--attention-backend torch``: torch's
  attention instead, as where a model's heads or blocks do not suit Triton's tiles);
- the KV pool takes what ``gpu_memory_utilization`` of the device's memory leaves after
  the weights and the activations of the largest step, measured by running one (as
  vLLM's profile run), unless ``num_kv_blocks`` or ``kv_cache_memory`` say;
- a step's inputs are built on the host and copied over without waiting; its logits
  come back for the sampler.

The worker takes any torch device (``device``): the tests run it on the CPU, its
attention through Triton's interpreter, against transformers. Quantization, tensor
parallelism and a draft model are the CPU worker's.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from kvserve.config.engine import EngineConfig
from kvserve.core.kv.groups import engine_kv_groups
from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.logger import init_logger
from kvserve.lora.manager import LoRAManager
from kvserve.model.execution import ExecutionMode, configure_layers
from kvserve.model.compressed import read_compressed_config
from kvserve.model.loader import load_model
from kvserve.worker.kv_pool_size import kv_cache_layout
from kvserve.worker.model_runner import ModelRunner, kv_bytes_per_block
from kvserve.worker.worker_base import KernelBuild, KVCacheLayout, ModelRunnerOutput, Worker

logger = init_logger(__name__)


def triton_backend(head_dim: int, block_size: int):
    """(the Triton attention backend or None, why not)."""
    try:
        from kvserve.kernels.triton_attention import TritonAttention, supports
    except ImportError as e:  # triton is not installed
        return None, f"triton is not importable ({e})"
    reason = supports(head_dim, block_size)
    return (None, reason) if reason else (TritonAttention(), "")


class CUDAWorker(Worker):
    def __init__(self, config: EngineConfig, model=None,
                 device: torch.device | str | None = None) -> None:
        """``device``: the torch device to run on (default: the current CUDA device)."""
        model_cfg, cache = config.model, config.cache
        for setting, on in (("quantization", model_cfg.quantization is not None),
                            ("a quantized checkpoint (compressed-tensors, GPTQ, AWQ)",
                             read_compressed_config(model_cfg.model_dir) is not None),
                            ("tensor_parallel_size > 1",
                             config.parallel.tensor_parallel_size > 1)):
            if on:
                raise ValueError(f"{setting} runs on the CPU worker only (--device cpu)")
        self.config = config
        self.device = torch.device(device if device is not None else "cuda")
        self.arch = model_cfg.arch
        start = time.perf_counter()
        self.model = model if model is not None else load_model(
            model_cfg.model_dir, model_cfg.arch, model_cfg.dtype, device=self.device)
        configure_layers(self.model, ExecutionMode(kernels=None, packed_linear=False,
                                                   linear_min_rows=1))
        self.kv_dtype = (model_cfg.dtype if cache.kv_cache_dtype == "auto"
                         else getattr(torch, cache.kv_cache_dtype))
        self.attention, why = (None, "--attention-backend torch")
        if config.worker.attention_backend == "auto":
            self.attention, why = triton_backend(self.arch.head_dim, cache.block_size)
        if self.attention is not None and (self.arch.attn_softcap is not None
                                           or self.arch.attention_sinks):
            self.attention, why = None, "soft-capped or sink attention"
        if self.attention is None:
            logger.info("attention on torch's path: %s", why)
        self.lora = (None if config.lora is None else
                     LoRAManager(self.model, config.lora, model_cfg.dtype, device=self.device))
        self.runner: ModelRunner | None = None
        logger.info("loaded %s (%s, %s) onto %s in %.1fs; max_model_len %d",
                    model_cfg.model_dir, model_cfg.arch.architecture, model_cfg.dtype,
                    self.device, time.perf_counter() - start, model_cfg.max_model_len)

    # -- the KV pool -----------------------------------------------------------------------

    def _zeros(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _runner(self, layout: KVCacheLayout) -> ModelRunner:
        cache = self.config.cache
        disk_path = (Path(cache.kv_offload_dir) / f"kvserve-kv-{os.getpid()}.bin"
                     if layout.disk_slots else None)
        return ModelRunner(self.model, self.arch, layout, self.kv_dtype, self.config.model.seed,
                           self.attention, disk_path, zeros=self._zeros,
                           groups=engine_kv_groups(self.config), device=self.device)

    def determine_kv_cache_layout(self) -> KVCacheLayout:
        cache = self.config.cache
        reserved = self.lora.reserved_bytes if self.lora is not None else 0
        if (self.device.type != "cuda" or cache.num_kv_blocks is not None
                or cache.kv_cache_memory is not None):
            return kv_cache_layout(self.config, self.arch, self.kv_dtype, reserved=reserved)
        groups = engine_kv_groups(self.config)
        per_block = kv_bytes_per_block(self.arch, cache.block_size, self.kv_dtype, groups)
        free, total = torch.cuda.mem_get_info(self.device)
        activations = self._profile_step()
        budget = (int(total * self.config.worker.gpu_memory_utilization)
                  - torch.cuda.memory_allocated(self.device) - activations - reserved
                  - (total - free - torch.cuda.memory_reserved(self.device)))
        num = budget // per_block
        if num < 1:
            raise ValueError(
                f"no device memory is left for the KV cache: {total / 2**30:.1f} GiB x "
                f"gpu_memory_utilization {self.config.worker.gpu_memory_utilization} less "
                f"the weights ({torch.cuda.memory_allocated(self.device) / 2**30:.2f} GiB), "
                f"the largest step's activations ({activations / 2**30:.2f} GiB) and other "
                "processes' memory; raise gpu_memory_utilization or lower "
                "max_num_batched_tokens")
        logger.info("KV cache: %d blocks x %d tokens = %.2f GiB of %s (gpu_memory_utilization "
                    "%.2f of %.1f GiB, after the weights and %.2f GiB of activations)", num,
                    cache.block_size, num * per_block / 2**30, self.kv_dtype,
                    self.config.worker.gpu_memory_utilization, total / 2**30,
                    activations / 2**30)
        return KVCacheLayout(num, cache.block_size, per_block,
                             str(self.kv_dtype).removeprefix("torch."))

    def _profile_step(self) -> int:
        """Bytes of activations the largest prompt step takes: one run over a pool just
        large enough, its peak over what was allocated before."""
        bs = self.config.cache.block_size
        tokens = self.config.warmup_tokens
        groups = engine_kv_groups(self.config)
        per_block = kv_bytes_per_block(self.arch, bs, self.kv_dtype, groups)
        layout = KVCacheLayout(tokens // bs + 2, bs, per_block,
                               str(self.kv_dtype).removeprefix("torch."))
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        runner = self._runner(layout)
        pool = torch.cuda.memory_allocated(self.device) - before
        runner.warm_up(tokens, max_prompt_len=tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before - pool
        del runner
        torch.cuda.empty_cache()
        return max(0, peak)

    def initialize_kv_cache(self, layout: KVCacheLayout) -> None:
        self.runner = self._runner(layout)
        self.runner.lora = self.lora

    # -- steps -----------------------------------------------------------------------------

    def warm_up(self) -> None:
        self.runner.warm_up(self.config.warmup_tokens)
        self.runner.synchronize()

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)

    def time_step_rows(self, row_counts: list[int]) -> dict[int, float]:
        return self.runner.time_rows(row_counts)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_int_id)

    def kernel_build(self) -> KernelBuild:
        """Whether the Triton kernels can run (a GPU worker builds no C kernels)."""
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return KernelBuild(False, f"triton is not importable ({e})")
        return KernelBuild(True, "")

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

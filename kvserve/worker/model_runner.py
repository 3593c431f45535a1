"""The model runner: owns the weights, the KV pool tensors and the sampler."""
from __future__ import annotations

from pathlib import Path

import torch

from kvserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvserve.kernels import NATIVE_KV_DTYPES, load_kernels
from kvserve.model.attention import KVCache
from kvserve.model.config import ModelConfig
from kvserve.model.layers import use_native_kernels, use_packed_linear
from kvserve.worker.gemm_warmup import warm_gemm_kernels
from kvserve.worker.input_batch import StepInputs, build_inputs
from kvserve.worker.kv_tiers import BlockStore, TierMover
from kvserve.worker.row_padding import set_min_rows, tune_min_rows
from kvserve.worker.sampler import Sampler, SampleResult


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, num_blocks: int,
                 block_size: int, kv_dtype: torch.dtype, seed: int, swap_slots: int = 0,
                 disk_slots: int = 0, disk_path: Path | None = None,
                 native_kernels: bool = True) -> None:
        self.model = model
        self.config = model_config
        self.block_size = block_size
        self.caches = [KVCache(num_blocks, block_size, model_config.num_kv_heads,
                               model_config.head_dim, kv_dtype)
                       for _ in range(model_config.num_layers)]
        self.sampler = Sampler(seed)
        self.swap = BlockStore(swap_slots, self.caches) if swap_slots else None
        self.disk = BlockStore(disk_slots, self.caches, disk_path) if disk_slots else None
        self.mover = TierMover(self.caches, self.swap, self.disk)
        self.native = None  # the native kernels; each layer uses them for the dtypes it can
        if native_kernels:
            kernels = load_kernels()
            self.native = kernels if kernels.available else None
            use_packed_linear(model)
        if self.native is not None:
            use_native_kernels(model, self.native)
        # attention math is float32 whatever the compute dtype (see paged_attention)
        self.native_attention = self.native if kv_dtype in NATIVE_KV_DTYPES else None

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, max_prompt_len: int = 512) -> int:
        """Run the model once on a dummy step of up to ``num_tokens`` prompt tokens, then
        once on one decode token per prompt, writing their K/V into blocks no request
        holds yet (any later owner writes a slot before reading it). The first real step
        then finds the heap grown, oneDNN's kernels generated and the threads started: a
        server's first 448-token request otherwise took ~240 ms longer than later ones.
        Returns the number of prompt tokens run (0 when the pool is too small)."""
        bs, num_blocks = self.block_size, self.caches[0].k.shape[0]
        prompt_len = min(num_tokens, max_prompt_len, num_blocks * bs - 1)  # + a decode slot
        if prompt_len < 1:
            return 0
        blocks_each = prompt_len // bs + 1
        num_prompts = min(num_tokens // prompt_len, num_blocks // blocks_each)
        tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(num_prompts)]
        steps = [[ScheduledRequest(f"warm-up-{i}", [0] * prompt_len, 0, t, None)
                  for i, t in enumerate(tables)],
                 [ScheduledRequest(f"warm-up-{i}", [0], prompt_len, t, None)
                  for i, t in enumerate(tables)]]
        for scheduled in steps:
            self._forward(build_inputs(scheduled, bs, self.config.sliding_window,
                                       self.native_attention))
        return num_prompts * prompt_len

    def pad_small_gemms(self, min_rows: int | None) -> tuple[int, dict[int, float]]:
        """Set the row count small GEMMs of the packed linear layers are padded to; None
        measures it (see :mod:`kvserve.worker.row_padding`). Returns (rows, the pass
        times measured, empty when not measured)."""
        if min_rows is None:
            return tune_min_rows(self.model)
        set_min_rows(self.model, min_rows)
        return min_rows, {}

    def warm_gemm_kernels(self, max_rows: int) -> tuple[int, int]:
        """Generate the GEMM kernels of row counts 1..max_rows (see
        :mod:`kvserve.worker.gemm_warmup`); returns (shapes, row counts warmed)."""
        return warm_gemm_kernels(self.model, max_rows)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        """Run one step; returns the sampled token of every request that samples."""
        self.sampler.drop(out.finished_ids)
        if out.kv_transfers:
            self.mover.run(out.kv_transfers)
        if out.block_copies:
            src = torch.tensor([s for s, _ in out.block_copies])
            dst = torch.tensor([d for _, d in out.block_copies])
            for cache in self.caches:
                cache.copy_blocks(src, dst)
        if not out.scheduled:
            return {}
        inputs = build_inputs(out.scheduled, self.block_size, self.config.sliding_window,
                              self.native_attention)
        logits = self._forward(inputs)
        if not inputs.sample_order:
            return {}
        ids = [s.request_id for s in inputs.sample_order]
        results = self.sampler(logits, ids, [s.sampling for s in inputs.sample_order])
        return dict(zip(ids, results))

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The logits of the step's sampling rows. Only those rows go through the last
        layer's attention output, o_proj and MLP (the other rows' K/V are all a later
        step needs): a prompt chunk skips 1/num_layers of its work but its K/V
        projection (bench-100m, 12 layers: ~7 % of a prefill's linear work)."""
        rows = inputs.sample_rows
        out_rows = None if len(rows) == len(inputs.tokens) else rows
        hidden = self.model(inputs.tokens, inputs.positions, self.caches, inputs.meta,
                            out_rows)
        return self.model.compute_logits(hidden)

"""The model runner: owns the model's tensors for a step — KV pool, inputs, sampler.

It is handed a model whose layers are already configured and the kernels attention
may use; what to choose is the worker's business (:mod:`kvserve.worker.cpu_worker`).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from kvserve.core.kv.groups import KVGroups
from kvserve.core.scheduler_output import SamplingInfo, ScheduledRequest, SchedulerOutput
from kvserve.model.attention import KVCache
from kvserve.sampling_params import SamplingParams
from kvserve.model.config import ArchConfig
from kvserve.worker.input_batch import StepInputs, build_inputs
from kvserve.worker.kv_tiers import BlockStore, TierMover
from kvserve.worker.rejection_sampler import RejectionSampler
from kvserve.worker.sampler import Sampler, SampleResult
from kvserve.worker.worker_base import KVCacheLayout, ModelRunnerOutput

# SamplingParams that ask for k top logprobs, one per k (prompt logprobs reuse the
# sampler's logprob code)
_LOGPROBS = {k: SamplingParams(temperature=0.0, logprobs=k) for k in range(21)}
# the warm-up's layers: one with every row, then a last (a model runs one per pool given)
WARM_UP_LAYERS = 2
# the most multiply-adds the warm-up's prompt spends in a layer's linear layers: a
# model-sized prompt on an 8B model's first layer would take seconds of a start-up to
# prepare for a step whose own cost dwarfs what warming saves
WARM_UP_LAYER_MACS = 32e9


def kv_bytes_per_block(cfg: ArchConfig, block_size: int, dtype: torch.dtype,
                       groups: KVGroups | None = None) -> int:
    """A block's bytes: every layer's K and V, or with KV groups one group's layers'."""
    elem = torch.tensor([], dtype=dtype).element_size()
    layers = cfg.num_layers if groups is None else groups.slots
    return 2 * layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ArchConfig, layout: KVCacheLayout,
                 kv_dtype: torch.dtype, seed: int, attention_kernels=None,
                 disk_path: Path | None = None, zeros=torch.zeros,
                 groups: KVGroups | None = None,
                 device: torch.device = torch.device("cpu")) -> None:
        """``attention_kernels``: native kernels that read this pool's dtype (or the
        Triton backend, on a GPU), or None for torch attention; ``zeros`` allocates the
        pools (see KVCache); ``groups``: the KV groups sharing the pool (a block holds one
        group's layers); ``device``: where the model and the pools are (a step's inputs
        are built on the CPU and copied there, and its logits come back for sampling)."""
        self.model = model
        self.device = device
        self.config = arch
        self.block_size = layout.block_size
        self.groups = groups
        self.pools = [KVCache(layout.num_blocks, layout.block_size, arch.num_kv_heads,
                              arch.head_dim, kv_dtype, zeros)
                      for _ in range(arch.num_layers if groups is None else groups.slots)]
        self.caches = (self.pools if groups is None  # each layer's
                       else [self.pools[s] for s in groups.layer_slot])
        if groups is not None:
            for layer, (g, window) in enumerate(
                    (g, groups.windows[g]) for g in groups.layer_group):
                model.model.layers[layer].self_attn.meta_key = (window, g) if window else 0
        self.sampler = Sampler(seed)
        self.verifier = RejectionSampler(self.sampler)
        self.swap = BlockStore(layout.swap_slots, self.pools) if layout.swap_slots else None
        self.disk = (BlockStore(layout.disk_slots, self.pools, disk_path)
                     if layout.disk_slots else None)
        self.mover = TierMover(self.pools, self.swap, self.disk)
        self.native_attention = attention_kernels
        self.captured = None  # a CapturedStep, set by the worker unless eager is enforced
        self.mask_wait_seconds = 0.0  # sampling waited this long for grammar masks
        # embedding requests pooled over chunks: request id -> (sum of rows, how many)
        self._pooling: dict[str, tuple[torch.Tensor, int]] = {}
        self.lora = None  # a LoRAManager (kvserve/lora/manager.py) when adapters are served

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, max_prompt_len: int = 512) -> int:
        """Run the model once on a dummy step of up to ``num_tokens`` prompt tokens, then
        once on one decode token per prompt, writing their K/V into blocks no request
        holds yet (any later owner writes a slot before reading it). The first real step
        then finds the heap grown, oneDNN's kernels generated and the threads started,
        instead of paying for them in a user's first request. Only the first
        WARM_UP_LAYERS layers run: every layer has the same shapes, and a step's last
        one takes only the rows that give logits (none here), so the layers before it
        grow the heap and generate the kernels as the whole model would, at a fraction
        of its cost; the prompt is shortened where a layer would spend more than
        WARM_UP_LAYER_MACS on it. Returns the number of prompt tokens run (0 when the pool
        is too small)."""
        bs, num_blocks = self.block_size, self.caches[0].k.shape[0]
        num_tokens = min(num_tokens, self._warm_up_token_cap())
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
            self.forward(self.step_inputs(scheduled), self.caches[:WARM_UP_LAYERS])
        return num_prompts * prompt_len

    def _warm_up_token_cap(self) -> int:
        """The prompt tokens whose pass through the first layer's linear layers stays
        within WARM_UP_LAYER_MACS (no cap for a model without a ``model.layers`` list)."""
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if not layers:
            return 1 << 30
        macs = sum(m.in_features * m.out_features for m in layers[0].modules()
                   if isinstance(m, torch.nn.Linear))
        return max(1, int(WARM_UP_LAYER_MACS // macs)) if macs else 1 << 30

    @torch.inference_mode()
    def time_rows(self, row_counts: list[int], context: int = 128, rounds: int = 3,
                  all_rows_sample: bool = True) -> dict[int, float]:
        """Median seconds of a step of ``rows`` rows after ``context`` tokens that all give
        logits (a request verifying ``rows - 1`` drafts), or with ``all_rows_sample``
        False only the last (a prompt chunk), for each row count the pool has room for;
        the rows' K/V go to blocks no request holds yet."""
        bs, num_blocks = self.block_size, self.caches[0].k.shape[0]
        info = SamplingInfo(SamplingParams(), (), (), None)
        times = {}
        room = min(num_blocks * bs, self.config.max_position_embeddings)
        for rows in sorted(set(row_counts)):
            if context + rows > room:
                break
            table = list(range(-(-(context + rows) // bs)))
            drafts = rows - 1 if all_rows_sample else 0
            step = [ScheduledRequest("cost", [0] * rows, context, table, info, drafts)]
            times[rows] = self._median_step(step, rounds)
        return times

    def _median_step(self, scheduled: list[ScheduledRequest], rounds: int,
                     warm: bool = True) -> float:
        """Median seconds of the model on ``scheduled`` over ``rounds`` runs, after one
        that only warms up (``warm``)."""
        inputs = self.step_inputs(scheduled)
        samples = []
        for _ in range(rounds + warm):
            start = time.perf_counter()
            self.forward(inputs)
            self.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[warm:])

    @torch.inference_mode()
    def time_decodes(self, counts: list[int], context: int = 128, rounds: int = 3,
                     warm: bool = True) -> dict[int, float]:
        """Median seconds of a step of ``n`` requests decoding one token each after
        ``context`` tokens (a draft model's pass), for each ``n``, each after a step
        that only warms up (``warm``); every request reads and writes the same blocks,
        which no request holds yet."""
        bs = self.block_size
        if context + 1 > min(self.caches[0].k.shape[0] * bs, self.config.max_position_embeddings):
            return {}
        table = list(range(context // bs + 1))
        info = SamplingInfo(SamplingParams(), (), (), None)
        times = {}
        for n in sorted(set(counts)):
            step = [ScheduledRequest(f"cost-{i}", [0], context, table, info) for i in range(n)]
            times[n] = self._median_step(step, rounds, warm)
        return times

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def step_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        """The tensors of a step of ``scheduled`` for this model and pool."""
        return build_inputs(scheduled, self.block_size, self.config.sliding_window,
                            self.native_attention, self.config.layer_windows, self.groups,
                            self.config.attention_sinks).to(self.device)

    def synchronize(self) -> None:
        """Wait for the device's queued work (a GPU runs a step asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: K/V moves and copies first, then the model on the flat batch."""
        self.sampler.drop(out.finished_ids)
        for rid in out.finished_ids:  # an aborted embedding request's partial sums
            self._pooling.pop(rid, None)
        if out.kv_transfers:
            self.mover.run(out.kv_transfers)
        if out.block_copies:
            src = torch.tensor([s for s, _ in out.block_copies], device=self.device)
            dst = torch.tensor([d for _, d in out.block_copies], device=self.device)
            for cache in self.pools:
                cache.copy_blocks(src, dst)
        result = ModelRunnerOutput()
        if not out.scheduled:
            return result
        adapted = self.lora is not None and any(s.lora is not None for s in out.scheduled)
        try:
            return self._execute(out, result, adapted)
        finally:
            if adapted:
                self.lora.end_step()

    def _execute(self, out: SchedulerOutput, result: ModelRunnerOutput, adapted: bool
                 ) -> ModelRunnerOutput:
        # a decode step the captured step covers needs no StepInputs (nor adapters: a step
        # with any runs eager)
        logits = (self.captured.decode(out.scheduled)
                  if self.captured is not None and not adapted else None)
        if logits is not None:
            order, num_draft_rows = out.scheduled, 0
        else:
            inputs = self.step_inputs(out.scheduled)
            if adapted:
                self.lora.begin_step(inputs.order)
            if inputs.pool_rows is not None:
                hidden = self.forward_hidden(inputs)
                num_logits = hidden.shape[0] - len(inputs.pool_rows)
                result.pooled = self._pool(hidden[num_logits:].cpu(), inputs)
                logits = self.model.compute_logits(hidden[:num_logits])
            else:
                logits = self.forward(inputs)
            logits = logits.cpu()  # the sampler's host side (a no-op on the CPU)
            num_sample = len(inputs.sample_rows)
            if inputs.prompt_spans:
                result.prompt_logprobs = self._prompt_logprobs(logits[num_sample:], inputs)
            if num_sample < logits.shape[0]:
                logits = logits[:num_sample]
            order, num_draft_rows = inputs.sample_order, inputs.num_draft_rows
        token_masks = out.token_masks
        if hasattr(token_masks, "result"):  # computed while the model ran
            start = time.perf_counter()
            token_masks = token_masks.result()
            self.mask_wait_seconds += time.perf_counter() - start
        if not order:
            return result
        ids = [s.request_id for s in order]
        infos = [s.sampling for s in order]
        masks = [token_masks.get(rid) for rid in ids] if token_masks else None
        if num_draft_rows:
            drafts = [s.token_ids[len(s.token_ids) - s.num_draft_tokens:] for s in order]
            result.sampled = dict(zip(ids, self.verifier(logits, ids, infos, drafts, masks)))
        else:
            row_masks = None if masks is None else [None if m is None else m[0] for m in masks]
            result.sampled = {rid: [r] for rid, r in zip(
                ids, self.sampler(logits, ids, infos, row_masks))}
        return result

    def _prompt_logprobs(self, logits: torch.Tensor, inputs: StepInputs
                         ) -> dict[str, tuple[int, list[SampleResult]]]:
        """Each scored prompt token's logprob, rank and the top ones (raw distribution)."""
        out, first = {}, 0
        for s, position, tokens in inputs.prompt_spans:
            rows = logits[first:first + len(tokens)].float()
            info = SamplingInfo(_LOGPROBS[s.prompt_logprobs.num_top], (), (), None)
            out[s.request_id] = (position, self.sampler._results(
                rows, torch.tensor(tokens), [info] * len(tokens)))
            first += len(tokens)
        return out

    def _pool(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """Each embedding chunk's rows into its request's pooled vector; the vectors of
        the requests whose prompt ended, cut and normalised as asked."""
        done, first = {}, 0
        for s, count in inputs.pool_spans:
            rows = hidden[first:first + count].float()
            first += count
            if s.start_pos == 0:  # a new prompt, or one recomputed after a preemption
                self._pooling.pop(s.request_id, None)
            total, n = self._pooling.get(s.request_id, (None, 0))
            if count:
                part = rows.sum(0)
                total, n = (part if total is None else total + part), n + count
                self._pooling[s.request_id] = (total, n)
            if s.pool_done:
                self._pooling.pop(s.request_id, None)
                vec = total / n
                if s.pooling.dimensions is not None:
                    vec = vec[:s.pooling.dimensions]
                if s.pooling.normalize:
                    vec = torch.nn.functional.normalize(vec, dim=0)
                done[s.request_id] = vec
        return done

    def forward_hidden(self, inputs: StepInputs) -> torch.Tensor:
        """The final hidden states of the step's sampling, prompt-scoring and pooled rows,
        in that order (eager: a pooled step is a prompt chunk)."""
        rows = torch.cat([inputs.sample_rows] + [r for r in (inputs.prompt_rows,
                                                             inputs.pool_rows)
                                                 if r is not None])
        if self._adapted():  # adapted layers see every row: the rows are picked after
            return self.model(inputs.tokens, inputs.positions, self.caches, inputs.meta)[rows]
        return self.model(inputs.tokens, inputs.positions, self.caches, inputs.meta, rows)

    def _adapted(self) -> bool:
        """Whether rows of the running step read LoRA adapters."""
        return self.lora is not None and self.lora.rows.slots is not None

    def forward(self, inputs: StepInputs, caches: list[KVCache] | None = None
                ) -> torch.Tensor:
        """The logits of the step's sampling rows, then of its prompt-scoring rows. Only
        those rows go through the last layer's attention output, o_proj and MLP (the
        other rows' K/V are all a later step needs): a prompt chunk skips most of one
        layer's work. A step the captured step covers runs there, as one native call.
        ``caches``: the first layers' pools, to run only those layers (the warm-up)."""
        adapted = self._adapted()
        if (caches is None and self.captured is not None and not adapted
                and self.captured.covers(inputs)):
            return self.captured(inputs)
        rows = inputs.sample_rows
        if inputs.prompt_rows is not None:
            rows = torch.cat([rows, inputs.prompt_rows])
        out_rows = None if len(rows) == len(inputs.tokens) and inputs.prompt_rows is None \
            else rows
        caches = self.caches if caches is None else caches
        if adapted and out_rows is not None:  # adapted layers see every row
            hidden = self.model(inputs.tokens, inputs.positions, caches, inputs.meta)[out_rows]
        else:
            hidden = self.model(inputs.tokens, inputs.positions, caches, inputs.meta, out_rows)
        return self.model.compute_logits(hidden)

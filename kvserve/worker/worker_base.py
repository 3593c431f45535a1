"""The worker boundary: everything between a scheduled step and its sampled tokens.

The engine decides (schedule, update, outputs); a :class:`Worker` computes. It owns what
depends on the platform: threads and memory settings, the model's weights and the way
its layers run, the KV pool (its size and its tensors), start-up warm-up and
measurements. The engine talks to it through this interface only, so a GPU worker, or
one worker per tensor-parallel rank behind an executor, fits in without the engine
changing. Calls come in this order, all run on kvserve's compute thread
(:mod:`kvserve.worker.compute_thread`)::

    worker = SomeWorker(config)                 # threads, model loaded
    layout = worker.determine_kv_cache_layout() # how many blocks fit, tiers' slots
    worker.initialize_kv_cache(layout)          # the pool tensors
    worker.warm_up()                            # dummy steps, measurements
    worker.finish_startup()                     # after the engine's own start-up work
    worker.execute_model(scheduler_output) ...  # every step
    worker.close()

With speculation by a draft model the worker runs the draft too, next to the target:
``load_draft_model`` (after ``initialize_kv_cache``) gives it its own runner and KV pool,
and each step's ``propose_drafts`` runs its passes; the engine keeps only the copy of
what the draft's KV holds that the worker reports back.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.worker.sampler import SampleResult
from kvserve.worker.step_profiler import StepTimeStats


class WorkerDiedError(RuntimeError):
    """A part of the worker is gone (a tensor-parallel rank exited): no step can run
    again, and the engine must stop rather than wait for it."""


@dataclass(frozen=True)
class KVCacheLayout:
    """The KV pool the worker allocates and the KV manager accounts for."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    dtype_name: str           # element type of the pool, e.g. "float32"
    swap_slots: int = 0       # host swap space, in blocks
    disk_slots: int = 0       # disk tier, in blocks


@dataclass
class ModelRunnerOutput:
    """What one step computed: each sampling request's new tokens (one, or its accepted
    drafts plus one), and the logprobs of prompt tokens where a request asked for them
    (request id -> (position of the first token scored, one result per token))."""

    sampled: dict[str, list[SampleResult]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[SampleResult]]] = field(default_factory=dict)
    # embedding requests whose prompt ended this step: the pooled vector (float32)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class TransferStats:
    """Bytes and seconds spent moving KV between tiers, cumulative, by direction."""

    bytes_moved: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class KernelBuild:
    """Whether the worker's native kernels were built; when not, why (its slower torch
    paths run instead)."""

    compiled: bool
    reason: str = ""


@dataclass(frozen=True)
class DraftModelInfo:
    """A draft model the worker loaded: its KV pool and how far its positions reach."""

    num_blocks: int
    max_positions: int


@dataclass(frozen=True)
class DraftAsk:
    """One request's ask for drafts: its tokens from ``start`` to its last one, and at
    most how many drafts. ``start`` is at most the tokens the draft's KV holds of it
    (:attr:`DraftProposal.held`) and below its last token, whose logits give the first
    draft."""

    request_id: str
    start: int
    token_ids: list[int]
    num_drafts: int

    @property
    def num_tokens(self) -> int:
        """The request's tokens, all told."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class DraftProposal:
    """What a call for drafts gave: each request's guessed next tokens (a request asked
    may get none), and for every request whose KV the draft now holds, how many of its
    first tokens that is."""

    drafts: dict[str, list[int]]
    held: dict[str, int]


class Worker(ABC):
    @abstractmethod
    def determine_kv_cache_layout(self) -> KVCacheLayout:
        """How large the KV pool and its tiers are (settings, or the memory free)."""

    @abstractmethod
    def initialize_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate the pool (and tiers) of ``layout``."""

    @abstractmethod
    def warm_up(self) -> None:
        """Run whatever makes the first real steps as fast as later ones."""

    def finish_startup(self) -> None:
        """Called once the engine is ready to serve."""

    def settle(self) -> None:
        """Return once the work start-up leaves running (backing the KV pool's pages) is
        done: before timing steady steps."""

    @abstractmethod
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step."""

    @abstractmethod
    def time_step_rows(self, row_counts: list[int]) -> dict[int, float]:
        """Seconds of a step by its row count (speculative decoding's cost model)."""

    def load_draft_model(self, model_dir: str) -> DraftModelInfo:
        """Load a draft model for speculative decoding, with its own KV pool, warmed up;
        after initialize_kv_cache."""
        raise NotImplementedError(f"{type(self).__name__} cannot run a draft model")

    @abstractmethod
    def kernel_build(self) -> KernelBuild:
        """Whether the native kernels built (the server reports it)."""

    def time_draft_model(self, batch_sizes: list[int], chunk_lengths: list[int]
                         ) -> tuple[dict[int, float], dict[int, float]]:
        """Seconds of a draft pass by the requests in it (one token each), and of a
        catch-up by the tokens in it (one request)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run a draft model")

    def propose_drafts(self, asks: list[DraftAsk]) -> DraftProposal:
        """The draft model's greedy guesses for the requests asked; a request not asked
        may give its draft KV back (when the pool runs short)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run a draft model")

    def forget_drafts(self, request_ids: list[str]) -> None:
        """The draft KV of requests that finished goes back to its pool."""

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget a LoRA adapter (unloaded): its weights read and its slot."""

    def transfer_stats(self) -> TransferStats:
        return TransferStats()

    def tuning_plan(self):
        """What start-up measured and chose (a TuningPlan; None where the worker
        measures nothing)."""
        return None

    def step_time_stats(self) -> StepTimeStats:
        """Where the profiled steps' time went (empty when the worker does not profile)."""
        return StepTimeStats()

    def close(self) -> None:
        """Release files and memory the worker holds."""

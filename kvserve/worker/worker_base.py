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
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

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

    @abstractmethod
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step."""

    @abstractmethod
    def time_step_rows(self, row_counts: list[int]) -> dict[int, float]:
        """Seconds of a step by its row count (speculative decoding's cost model)."""

    def create_draft_runner(self, model_dir: str):
        """(a runner over a draft model for speculative decoding, its pool's block
        count); after initialize_kv_cache."""
        raise NotImplementedError(f"{type(self).__name__} cannot run a draft model")

    @abstractmethod
    def kernel_build(self) -> KernelBuild:
        """Whether the native kernels built (the server reports it)."""

    def transfer_stats(self) -> TransferStats:
        return TransferStats()

    def step_time_stats(self) -> StepTimeStats:
        """Where the profiled steps' time went (empty when the worker does not profile)."""
        return StepTimeStats()

    def close(self) -> None:
        """Release files and memory the worker holds."""

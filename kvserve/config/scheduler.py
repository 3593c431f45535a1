"""SchedulerConfig: what the scheduler and its batching policy need."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.validate import choice, non_negative_int, number, positive_int

SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prefill_join_tokens: int = 0          # 0: a prompt may join a step up to the budget
    batching: str = "continuous"          # a name in kvserve.core.batching.BATCHING_POLICIES
    scheduling_policy: str = "fcfs"
    max_batch_size: int = 16              # static batches and released length buckets
    bucket_window_s: float = 0.1
    preemption_mode: str = "recompute"
    background_step_tokens: int = 2      # background tokens a step while foreground runs
    async_scheduling: bool = False        # the next step starts before this one's outputs

    def __post_init__(self) -> None:
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        non_negative_int("prefill_join_tokens", self.prefill_join_tokens, "no limit")
        choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if self.scheduling_policy == "priority" and self.batching != "continuous":
            raise ValueError("scheduling_policy 'priority' applies to continuous batching; "
                             f"batching is {self.batching!r}")
        choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        positive_int("max_batch_size", self.max_batch_size)
        number("bucket_window_s", self.bucket_window_s, low=0.0)
        non_negative_int("background_step_tokens", self.background_step_tokens,
                         "background requests wait while foreground ones run")

    @property
    def swap_on_preemption(self) -> bool:
        return self.preemption_mode == "swap"

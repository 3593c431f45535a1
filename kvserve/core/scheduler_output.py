"""The narrow seam between the scheduler (decides) and the model runner (computes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from kvserve.core.kv.interface import KVStats
from kvserve.core.kv.tiers import KVTransfer
from kvserve.lora.request import LoRARequest
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingInfo:
    """What the sampler needs of a request; token lists are read-only views."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_id: int | None


@dataclass(frozen=True)
class PromptLogprobsInfo:
    """A prompt chunk whose rows must also give the next prompt token's logprob."""

    num_top: int                       # top logprobs per token besides its own
    prompt_token_ids: Sequence[int]    # the whole prompt: a chunk's last row predicts the
                                       # next chunk's first token


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]      # the tokens to compute this step
    start_pos: int            # tokens already in the KV cache
    block_table: list[int]
    sampling: SamplingInfo | None  # set when this step ends the prompt or is a decode
    num_draft_tokens: int = 0  # the last ones of token_ids: guesses the step verifies
    prompt_logprobs: PromptLogprobsInfo | None = None
    # the windowed KV groups' tables (see core/kv/groups.py), when the model has them
    group_tables: tuple[list[int], ...] = ()
    # an embedding request's chunk: its rows' hidden states are pooled (resolved params);
    # pool_done: the chunk ends the prompt, so the pooled vector is whole after the step
    pooling: PoolingParams | None = None
    pool_done: bool = False
    lora: LoRARequest | None = None  # the adapter its rows run with


    @property
    def sample(self) -> bool:
        return self.sampling is not None


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state as a step was scheduled: what metrics and benchmarks read."""

    num_running: int
    num_waiting: int
    num_preemptions: int      # cumulative
    kv: KVStats
    num_scheduled_tokens: int = 0  # tokens the step computes (0 between steps)
    num_scheduled_requests: int = 0
    num_decode_requests: int = 0   # of the step's requests, those computing one new token
    preempted: tuple[str, ...] = ()  # requests preempted while scheduling the step
    # LoRA adapters (names) of the running and the waiting requests, when adapters are on
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # done before the step
    kv_transfers: list[KVTransfer] = field(default_factory=list)  # swap / disk, before copies
    finished_ids: list[str] = field(default_factory=list)  # runner may drop their state
    stats: SchedulerStats | None = None  # set when the step runs something
    # structured outputs: request id -> allowed tokens [its sampling rows, vocab] (bool),
    # or a Future of that dict (computed while the model runs)
    token_masks: Any = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.block_copies and not self.kv_transfers

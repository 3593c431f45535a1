"""Request state as the scheduler sees it: tokens, progress and status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.lora.request import LoRARequest
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    Invariants: ``num_computed_tokens <= num_tokens``; the KV cache holds exactly the
    first ``num_computed_tokens`` tokens of ``all_token_ids``; after a preemption by
    recompute ``num_computed_tokens`` is 0 and the generated tokens are kept, so the
    request re-prefills prompt + output and continues where it stopped.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int  # resolved: never None, capped by max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    background: bool = False  # a batch line: below every foreground request (scheduler)
    # an embedding request: its prompt's hidden states pooled, nothing generated
    pooling: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold in the KV cache."""
        return self.num_prompt_tokens + self.max_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def prefix_root(self) -> int | None:
        """The root of its prefix-cache hashes: KV is shared only within one adapter."""
        return None if self.lora_request is None else self.lora_request.prefix_key

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

"""Batching policies: which waiting requests the scheduler may admit this step.

The scheduler owns the queues and the KV; a policy only filters and orders the waiting
queue. The scheduler then admits the returned requests in order while the token budget,
``max_num_seqs`` and KV memory allow, and stops at the first that does not fit.

- ``continuous`` (vLLM, iteration level): every waiting request, in queue order (FCFS, or
  by priority when the scheduler keeps the queue sorted).
- ``length-bucket`` (xLLM's dynamic batcher): waiting requests are grouped by prompt
  length into power-of-two buckets ((16, 32], (32, 64], ...). A bucket is released as a
  batch of up to ``max_batch_size`` requests when it holds ``max_batch_size`` requests or
  its oldest request has waited ``bucket_window_s``; released requests stay admissible
  until memory lets them in.
- ``static`` (HF ``generate``): take up to ``max_batch_size`` waiting requests as one
  batch; admit nothing else until every request of the batch has finished.

Under every policy a request that was preempted had already been admitted once: it is
admissible again at once, ahead of new requests. Policies are registered by name in
``BATCHING_POLICIES`` at the end of this module, one line each.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from itertools import islice
from typing import Sequence

from kvserve.config.scheduler import SchedulerConfig
from kvserve.registry import Registry
from kvserve.request import Request, RequestStatus


class BatchingPolicy(ABC):
    name: str

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> BatchingPolicy:
        """Build from the scheduler settings; policies with options override this."""
        return cls()

    @abstractmethod
    def admissible(self, waiting: Sequence[Request], now: float) -> list[Request]:
        """The waiting requests that may be admitted now, in the order to try them."""


class ContinuousBatching(BatchingPolicy):
    name = "continuous"

    def admissible(self, waiting: Sequence[Request], now: float) -> list[Request]:
        return list(waiting)


class StaticBatching(BatchingPolicy):
    name = "static"

    def __init__(self, max_batch_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.batch: list[Request] = []

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> StaticBatching:
        return cls(config.max_batch_size)

    def admissible(self, waiting: Sequence[Request], now: float) -> list[Request]:
        self.batch = [r for r in self.batch if not r.is_finished]
        if not self.batch:
            self.batch = list(islice(waiting, self.max_batch_size))
        members = set(self.batch)
        return [r for r in waiting if r in members]


def length_bucket(num_prompt_tokens: int) -> int:
    """Bucket b holds prompts of length (2^(b-1), 2^b]."""
    return max(0, (num_prompt_tokens - 1).bit_length())


class LengthBucketBatching(BatchingPolicy):
    name = "length-bucket"

    def __init__(self, max_batch_size: int, window_s: float) -> None:
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self.released: set[Request] = set()

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> LengthBucketBatching:
        return cls(config.max_batch_size, config.bucket_window_s)

    def admissible(self, waiting: Sequence[Request], now: float) -> list[Request]:
        self.released = {r for r in self.released if r.status == RequestStatus.WAITING}
        buckets: dict[int, list[Request]] = {}
        for req in waiting:
            if req.status == RequestStatus.WAITING and req not in self.released:
                buckets.setdefault(length_bucket(req.num_prompt_tokens), []).append(req)
        ready = []
        for reqs in buckets.values():
            oldest = min(r.arrival_time for r in reqs)
            if len(reqs) >= self.max_batch_size or now - oldest >= self.window_s:
                ready.append((oldest, reqs[:self.max_batch_size]))
        for _, batch in sorted(ready, key=lambda item: item[0]):
            self.released.update(batch)
        return [r for r in waiting if r.status == RequestStatus.PREEMPTED] + [
            r for r in waiting if r in self.released]


BATCHING_POLICIES: Registry[type[BatchingPolicy]] = Registry("batching")
BATCHING_POLICIES.register("continuous", ContinuousBatching)
BATCHING_POLICIES.register("length-bucket", LengthBucketBatching)
BATCHING_POLICIES.register("static", StaticBatching)


def create_batching_policy(config: SchedulerConfig) -> BatchingPolicy:
    """The policy ``config.batching`` names."""
    return BATCHING_POLICIES[config.batching].from_config(config)


__all__ = ["BatchingPolicy", "ContinuousBatching", "StaticBatching", "LengthBucketBatching",
           "BATCHING_POLICIES", "create_batching_policy", "length_bucket"]

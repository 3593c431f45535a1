"""EngineSnapshot: what the server reads about the engine, published by its thread."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_utilization: float = 1.0
    kv_fragmentation: float = 0.0
    num_preemptions: int = 0
    prefix_hit_rate: float | None = None
    prefix_queries: int = 0  # cumulative tokens
    prefix_hits: int = 0
    transfer_bytes: dict = field(default_factory=dict)    # kind -> cumulative bytes
    transfer_seconds: dict = field(default_factory=dict)  # kind -> cumulative seconds
    spec_drafts: int = 0            # speculative decoding, cumulative (vLLM's meanings)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple = ()
    step_seconds: dict = field(default_factory=dict)  # part -> cumulative profiled seconds
    profiled_steps: int = 0
    running_loras: tuple = ()  # LoRA adapters of the running / waiting requests (names)
    waiting_loras: tuple = ()

    @classmethod
    def of(cls, stats) -> "EngineSnapshot":
        """From an engine's ``get_stats()`` (kvserve.engine.llm_engine.EngineStats)."""
        sched, kv, moved, spec = (stats.scheduler, stats.scheduler.kv, stats.transfers,
                                  stats.spec_decode)
        extra = {} if spec is None else {
            "spec_drafts": spec.num_drafts, "spec_draft_tokens": spec.num_draft_tokens,
            "spec_accepted_tokens": spec.num_accepted_tokens,
            "spec_accepted_per_pos": tuple(spec.accepted_per_position)}
        return cls(
            num_running=sched.num_running, num_waiting=sched.num_waiting, kv_usage=kv.usage,
            kv_utilization=kv.utilization, kv_fragmentation=kv.fragmentation,
            num_preemptions=sched.num_preemptions,
            prefix_hit_rate=kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else None,
            prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits,
            transfer_bytes=dict(moved.bytes_moved), transfer_seconds=dict(moved.seconds),
            step_seconds=stats.step_time.by_part(),
            profiled_steps=stats.step_time.profiled_steps, running_loras=sched.running_loras,
            waiting_loras=sched.waiting_loras, **extra)

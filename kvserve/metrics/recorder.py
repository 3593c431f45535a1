"""StatsRecorder: the engine thread's bookkeeping of requests and steps.

One recorder feeds every sink from the same events — the Prometheus collectors, the
live window behind ``/v1/stats`` and the dashboard, the request traces — and logs a
throughput line like vLLM's every ``log_interval`` seconds while the server is busy.
Each sink is optional. The work per event is a few additions and histogram
observations; percentiles and rates are left to the readers.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvserve.logger import init_logger
from kvserve.metrics.diagnostics import IntervalDiagnostics
from kvserve.metrics.live import LiveStats, Totals
from kvserve.metrics.prometheus import STEP_PARTS, TRANSFER_KINDS, ServerMetrics
from kvserve.metrics.snapshot import EngineSnapshot

logger = init_logger(__name__)

FAILED_REASONS = ("abort", "error")


@dataclass
class RequestRecord:
    """What the recorder keeps of a request in flight."""

    request_id: str
    arrival_time: float
    n: int = 1
    max_tokens: int | None = None
    params: object = None          # the SamplingParams (read by the tracer)
    trace_context: object = None   # the caller's trace, when tracing
    tokens: int = 0
    last_token_time: float | None = None
    first_token_seen: bool = False
    preempted_at: list[float] = field(default_factory=list)


def finish_reason(out) -> str:
    """One reason per request: error, then abort, length, stop (the worst of its outputs)."""
    if out.error:
        return "error"
    reasons = [o.finish_reason for o in out.outputs]
    return next((r for r in ("error", "abort", "length", "stop") if r in reasons), "stop")


class StatsRecorder:
    def __init__(self, metrics: ServerMetrics | None, log_interval: float = 10.0,
                 log: logging.Logger | None = None, live: LiveStats | None = None,
                 tracer=None) -> None:
        self.metrics = metrics
        self.live = live
        self.tracer = tracer
        self.log_interval = log_interval
        self.log = log or logger
        self._requests: dict[str, RequestRecord] = {}
        self._totals: dict[str, float] = {}   # last cumulative value forwarded, by key
        self._prompt_tokens = self._generation_tokens = 0
        self._finished = self._failed = 0
        self._last_log = time.monotonic()
        self._prompt_since_log = self._gen_since_log = 0
        self._was_busy = False
        self._spec_logged = EngineSnapshot()
        self.diagnostics = IntervalDiagnostics()

    # -- requests ------------------------------------------------------------------------

    def on_add(self, request_id: str, params, arrival_time: float,
               trace_headers: dict | None = None) -> None:
        rec = self._requests[request_id] = RequestRecord(
            request_id, arrival_time, n=getattr(params, "n", 1), max_tokens=getattr(params, "max_tokens", None),
            params=params)
        if self.tracer is not None:
            rec.trace_context = self.tracer.context_of(trace_headers)
        if self.metrics is not None and getattr(params, "structured_outputs", None) is not None:
            self.metrics.structured_output_requests.inc()

    def on_outputs(self, outputs, now: float) -> None:
        m = self.metrics
        for out in outputs:
            rec = self._requests.get(out.request_id)
            if rec is None:  # added without on_add (an engine driven directly)
                rec = self._requests[out.request_id] = RequestRecord(
                    out.request_id, out.metrics.arrival_time if out.metrics else now)
            if not rec.first_token_seen:
                rec.first_token_seen = True
                prompt = len(out.prompt_token_ids)
                self._prompt_tokens += prompt
                self._prompt_since_log += prompt
                first = out.metrics.first_token_time if out.metrics else None
                if first is not None:
                    if m:
                        m.time_to_first_token.observe(first - out.metrics.arrival_time)
                    if self.live:
                        self.live.ttft.append((now, first - out.metrics.arrival_time))
                if m:
                    m.prompt_tokens.inc(prompt)
            tokens = sum(len(o.token_ids) for o in out.outputs)
            new = tokens - rec.tokens
            if new > 0:
                self._generation_tokens += new
                self._gen_since_log += new
                if m:
                    m.generation_tokens.inc(new)
                if rec.last_token_time is not None:
                    interval = now - rec.last_token_time
                    if m:
                        m.inter_token_latency.observe(interval)
                        m.time_per_output_token.observe(interval)
                    if self.live:
                        self.live.tpot.append((now, interval / new))
                rec.tokens, rec.last_token_time = tokens, now
            if out.finished:
                self._finish(out, rec, finish_reason(out), now)

    def _finish(self, out, rec: RequestRecord, reason: str, now: float) -> None:
        self._requests.pop(rec.request_id, None)
        self._finished += 1
        self._failed += reason in FAILED_REASONS
        if self.tracer is not None:
            self.tracer.end(rec, out, reason, now)
        m = self.metrics
        if m is None:
            return
        m.request_success[reason].inc()
        m.request_params_n.observe(rec.n)
        if rec.max_tokens:
            m.request_params_max_tokens.observe(rec.max_tokens)
        if out is None:
            return
        m.request_prompt_tokens.observe(len(out.prompt_token_ids))
        m.request_generation_tokens.observe(sum(len(o.token_ids) for o in out.outputs))
        m.request_max_num_generation_tokens.observe(
            max((len(o.token_ids) for o in out.outputs), default=0))
        t = out.metrics
        if t is None or t.finished_time is None:
            return
        m.e2e_request_latency.observe(t.finished_time - t.arrival_time)
        if t.first_scheduled_time is not None:
            m.request_queue_time.observe(t.first_scheduled_time - t.arrival_time)
            m.request_inference_time.observe(t.finished_time - t.first_scheduled_time)
            if t.first_token_time is not None:
                prefill = t.first_token_time - t.first_scheduled_time
                m.request_prefill_time.observe(prefill)
                if out.prompt_token_ids:
                    m.time_per_prefill_token.observe(prefill / len(out.prompt_token_ids))
        if t.first_token_time is not None:
            m.request_decode_time.observe(t.finished_time - t.first_token_time)

    def on_abort(self, request_id: str) -> None:
        """A request aborted by the server (client gone, shutdown): no output comes back."""
        rec = self._requests.get(request_id) or RequestRecord(request_id, time.monotonic())
        self._finish(None, rec, "abort", time.monotonic())

    # -- steps and engine state ----------------------------------------------------------

    def on_step(self, stats, preempted: list[str], now: float) -> None:
        """A step that ran: its token count and batch composition, its preemptions."""
        for rid in preempted:
            rec = self._requests.get(rid)
            if rec is not None:
                rec.preempted_at.append(now)
        if stats is not None:
            self.diagnostics.on_step(stats)
        m = self.metrics
        if m is None or stats is None:
            return
        m.iteration_tokens.observe(stats.num_scheduled_tokens)
        m.iteration_decode_requests.observe(stats.num_decode_requests)
        m.iteration_prefill_tokens.observe(stats.num_scheduled_tokens
                                           - stats.num_decode_requests)

    def on_state(self, snap: EngineSnapshot, alive: bool = True) -> None:
        m = self.metrics
        if m:
            m.engine_healthy.set(1 if alive else 0)
            m.publish_loras(snap.running_loras, snap.waiting_loras)
            m.num_requests_running.set(snap.num_running)
            m.num_requests_waiting.set(snap.num_waiting)
            m.kv_cache_usage_perc.set(snap.kv_usage)
            m.gpu_cache_usage_perc.set(snap.kv_usage)
            m.kv_cache_utilization_perc.set(snap.kv_utilization)
            m.kv_cache_fragmentation_perc.set(snap.kv_fragmentation)
            self._forward(m.num_preemptions, "preemptions", snap.num_preemptions)
            for counter in (m.prefix_cache_queries, m.gpu_prefix_cache_queries):
                self._forward(counter, f"queries:{id(counter)}", snap.prefix_queries)
            for counter in (m.prefix_cache_hits, m.gpu_prefix_cache_hits):
                self._forward(counter, f"hits:{id(counter)}", snap.prefix_hits)
            for kind in TRANSFER_KINDS:
                self._forward(m.kv_transfer_bytes[kind], f"bytes:{kind}",
                              snap.transfer_bytes.get(kind, 0))
                self._forward(m.kv_transfer_seconds[kind], f"seconds:{kind}",
                              snap.transfer_seconds.get(kind, 0.0))
            for part in STEP_PARTS:
                self._forward(m.step_time_seconds[part], f"step:{part}",
                              snap.step_seconds.get(part, 0.0))
            self._forward(m.profiled_steps, "profiled", snap.profiled_steps)
            if snap.spec_draft_tokens:
                self._forward(m.spec_decode_num_drafts, "spec:drafts", snap.spec_drafts)
                self._forward(m.spec_decode_num_draft_tokens, "spec:draft_tokens",
                              snap.spec_draft_tokens)
                self._forward(m.spec_decode_num_accepted_tokens, "spec:accepted",
                              snap.spec_accepted_tokens)
                for pos, n in enumerate(snap.spec_accepted_per_pos):
                    self._forward(m.accepted_at(pos), f"spec:pos{pos}", n)
        if self.live:
            self.live.record(Totals(
                time.monotonic(), snap.num_running, snap.num_waiting, snap.kv_usage,
                snap.kv_utilization, snap.kv_fragmentation, self._prompt_tokens,
                self._generation_tokens, self._finished, self._failed, snap.num_preemptions,
                snap.prefix_queries, snap.prefix_hits,
                tuple(snap.transfer_bytes.get(k, 0) for k in TRANSFER_KINDS),
                tuple(snap.step_seconds.get(p, 0.0) for p in STEP_PARTS), snap.profiled_steps))

    def _forward(self, counter, key: str, cumulative: float) -> None:
        """Counters follow the engine's cumulative totals."""
        last = self._totals.get(key, 0)
        if cumulative > last:
            counter.inc(cumulative - last)
        self._totals[key] = cumulative

    # -- the log line --------------------------------------------------------------------

    def _log_spec_decode(self, snap: EngineSnapshot) -> None:
        """vLLM's speculative decoding line, over the drafts since the last one."""
        last = self._spec_logged
        drafts = snap.spec_drafts - last.spec_drafts
        if drafts <= 0:
            return
        tokens = snap.spec_draft_tokens - last.spec_draft_tokens
        accepted = snap.spec_accepted_tokens - last.spec_accepted_tokens
        per_pos = [(n - (last.spec_accepted_per_pos[i] if i < len(last.spec_accepted_per_pos)
                         else 0)) / drafts for i, n in enumerate(snap.spec_accepted_per_pos)]
        self.log.info("SpecDecoding metrics: Mean acceptance length: %.2f, Drafts: %d, "
                      "Draft tokens: %d, Accepted tokens: %d, Draft acceptance rate: %.1f%%, "
                      "Per-position acceptance rate: %s", 1 + accepted / drafts, drafts,
                      tokens, accepted, 100 * accepted / tokens if tokens else 0.0,
                      ", ".join(f"{p:.3f}" for p in per_pos))
        self._spec_logged = snap

    def maybe_log(self, snap: EngineSnapshot, now: float | None = None) -> bool:
        """Logs the throughput line once per interval while busy; True if it logged."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_log
        if self.log_interval <= 0 or elapsed < self.log_interval:
            return False
        busy = bool(self._prompt_since_log or self._gen_since_log or snap.num_running
                    or snap.num_waiting)
        if busy or self._was_busy:
            hit = ("" if snap.prefix_hit_rate is None
                   else f", Prefix cache hit rate: {snap.prefix_hit_rate * 100:.1f}%")
            self.log.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%%s",
                self._prompt_since_log / elapsed, self._gen_since_log / elapsed,
                snap.num_running, snap.num_waiting, snap.kv_usage * 100, hit)
            self._log_spec_decode(snap)
        for warning in self.diagnostics.end_interval(snap.num_preemptions):
            self.log.warning("%s", warning)
        self._was_busy = busy
        self._last_log = now
        self._prompt_since_log = self._gen_since_log = 0
        return busy

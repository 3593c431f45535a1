"""Prometheus metrics and the periodic stats log line, named like vLLM's (``kvserve:``).

:class:`ServerMetrics` owns one ``CollectorRegistry`` per server, so several servers in
one process never clash. :class:`StatsRecorder` runs on the engine thread: it turns each
step's RequestOutputs and the scheduler / KV state into metric observations and logs
a line like vLLM's every ``log_interval`` seconds while the server is busy.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

from kvserve.logger import init_logger

logger = init_logger(__name__)

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_REQUEST_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort", "error")
TRANSFER_KINDS = ("swap_out", "swap_in", "offload", "onload")


class ServerMetrics:
    """The server's Prometheus collectors, labelled with ``model_name`` like vLLM's."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"kvserve:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"kvserve:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"kvserve:{name}", doc, labels, buckets=buckets,
                             registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running",
                                          "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc",
                                         "KV-cache usage. 1 means 100 percent usage.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.")
        success = Counter("kvserve:request_success", "Count of finished requests by reason.",
                          labels + ["finished_reason"], registry=r)
        self.request_success = {reason: success.labels(model_name, reason)
                                for reason in FINISH_REASONS}
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time to first token in seconds.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "End to end request latency in seconds.",
                                             _REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Time spent waiting in the queue, in seconds.",
                                            _REQUEST_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds",
                                              "Time spent in prefill, in seconds.",
                                              _REQUEST_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds",
                                             "Time spent in decode, in seconds.",
                                             _REQUEST_BUCKETS)
        self.kv_cache_utilization_perc = gauge(
            "kv_cache_utilization_perc",
            "Share of handed-out KV slots that hold a token. 1 means 100 percent.")
        self.kv_cache_fragmentation_perc = gauge(
            "kv_cache_fragmentation_perc",
            "Share of KV slots lost to fragmentation: handed out but empty (internal) plus "
            "free but unusable for the next allocation (external). 1 means 100 percent.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        moved = Counter("kvserve:kv_transfer_bytes", "KV bytes moved between tiers, by kind "
                        "(swap_out, swap_in, offload, onload).", labels + ["kind"], registry=r)
        seconds = Counter("kvserve:kv_transfer_seconds", "Time spent moving KV between tiers, "
                          "by kind.", labels + ["kind"], registry=r)
        self.kv_transfer_bytes = {k: moved.labels(model_name, k) for k in TRANSFER_KINDS}
        self.kv_transfer_seconds = {k: seconds.labels(model_name, k) for k in TRANSFER_KINDS}
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts",
                                              "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                                    "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Number of accepted tokens.")
        self._accepted_per_pos = Counter(
            "kvserve:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", labels + ["position"], registry=r)
        self._model_name = model_name

    def accepted_at(self, position: int):
        return self._accepted_per_pos.labels(self._model_name, str(position))

    def publish_cache_config(self, info: dict[str, object]) -> None:
        """``kvserve:cache_config_info``: the KV cache settings as labels of a gauge at 1
        (vLLM's cache_config_info), set once the engine is loaded."""
        names = sorted(info)
        Gauge("kvserve:cache_config_info", "Information of the engine's KV cache config.",
              names, registry=self.registry).labels(*(str(info[n]) for n in names)).set(1)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


@dataclass(frozen=True)
class EngineSnapshot:
    """What the server reads about the engine (published by the engine thread)."""

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


@dataclass
class _Live:
    tokens: int = 0
    last_token_time: float | None = None


class StatsRecorder:
    """Engine-thread bookkeeping: per-request token counts and latencies, the log line."""

    def __init__(self, metrics: ServerMetrics | None, log_interval: float = 10.0,
                 log: logging.Logger | None = None) -> None:
        self.metrics = metrics
        self.log_interval = log_interval
        self.log = log or logger
        self._live: dict[str, _Live] = {}
        self._preemptions = 0
        self._totals: dict[str, float] = {}
        self._last_log = time.monotonic()
        self._prompt_since_log = 0
        self._gen_since_log = 0
        self._was_busy = False
        self._spec_logged = EngineSnapshot()

    def on_outputs(self, outputs, now: float) -> None:
        m = self.metrics
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                live = self._live[out.request_id] = _Live()
                self._prompt_since_log += len(out.prompt_token_ids)
                if m:
                    m.prompt_tokens.inc(len(out.prompt_token_ids))
                    if out.metrics and out.metrics.first_token_time:
                        m.time_to_first_token.observe(
                            out.metrics.first_token_time - out.metrics.arrival_time)
            tokens = sum(len(o.token_ids) for o in out.outputs)
            new = tokens - live.tokens
            if new > 0:
                self._gen_since_log += new
                if m:
                    m.generation_tokens.inc(new)
                    if live.last_token_time is not None:
                        m.inter_token_latency.observe(now - live.last_token_time)
                live.tokens, live.last_token_time = tokens, now
            if out.finished:
                self._finish(out)

    def _finish(self, out) -> None:
        self._live.pop(out.request_id, None)
        m = self.metrics
        if m is None:
            return
        reasons = [o.finish_reason for o in out.outputs]
        reason = "error" if out.error else next(
            (r for r in ("error", "abort", "length", "stop") if r in reasons), "stop")
        m.request_success[reason].inc()
        t = out.metrics
        if t is None or t.finished_time is None:
            return
        m.e2e_request_latency.observe(t.finished_time - t.arrival_time)
        if t.first_scheduled_time is not None:
            m.request_queue_time.observe(t.first_scheduled_time - t.arrival_time)
            if t.first_token_time is not None:
                m.request_prefill_time.observe(t.first_token_time - t.first_scheduled_time)
        if t.first_token_time is not None:
            m.request_decode_time.observe(t.finished_time - t.first_token_time)

    def on_abort(self, request_id: str) -> None:
        """A request aborted by the server (client gone, shutdown): no output comes back."""
        self._live.pop(request_id, None)
        if self.metrics:
            self.metrics.request_success["abort"].inc()

    def on_state(self, snap: EngineSnapshot) -> None:
        m = self.metrics
        if m:
            m.num_requests_running.set(snap.num_running)
            m.num_requests_waiting.set(snap.num_waiting)
            m.kv_cache_usage_perc.set(snap.kv_usage)
            m.kv_cache_utilization_perc.set(snap.kv_utilization)
            m.kv_cache_fragmentation_perc.set(snap.kv_fragmentation)
            if snap.num_preemptions > self._preemptions:
                m.num_preemptions.inc(snap.num_preemptions - self._preemptions)
            self._add_delta(m.prefix_cache_queries, "queries", snap.prefix_queries)
            self._add_delta(m.prefix_cache_hits, "hits", snap.prefix_hits)
            for kind in TRANSFER_KINDS:
                self._add_delta(m.kv_transfer_bytes[kind], f"bytes:{kind}",
                                snap.transfer_bytes.get(kind, 0))
                self._add_delta(m.kv_transfer_seconds[kind], f"seconds:{kind}",
                                snap.transfer_seconds.get(kind, 0.0))
            if snap.spec_draft_tokens:
                self._add_delta(m.spec_decode_num_drafts, "spec:drafts", snap.spec_drafts)
                self._add_delta(m.spec_decode_num_draft_tokens, "spec:draft_tokens",
                                snap.spec_draft_tokens)
                self._add_delta(m.spec_decode_num_accepted_tokens, "spec:accepted",
                                snap.spec_accepted_tokens)
                for pos, n in enumerate(snap.spec_accepted_per_pos):
                    self._add_delta(m.accepted_at(pos), f"spec:pos{pos}", n)
        self._preemptions = snap.num_preemptions

    def _add_delta(self, counter, key: str, cumulative: float) -> None:
        """Counters follow the engine's cumulative totals."""
        last = self._totals.get(key, 0)
        if cumulative > last:
            counter.inc(cumulative - last)
        self._totals[key] = cumulative

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
        self._was_busy = busy
        self._last_log = now
        self._prompt_since_log = self._gen_since_log = 0
        return busy

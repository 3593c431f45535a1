"""Serving metrics as ``vllm bench serve`` reports them, computed by a pure function
from per-request records (so they can be checked by hand on synthetic timings).

- TTFT: first token arrival - request start.
- TPOT: (E2EL - TTFT) / (output_len - 1), for requests with more than one token.
- ITL: every gap between consecutive token (chunk) arrivals, over all requests.
- E2EL: request end - request start.
Percentiles use linear interpolation between closest ranks (numpy's default).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence

__all__ = ["RequestRecord", "ServeMetrics", "compute_serve_metrics", "percentile", "peak_concurrency"]

METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """What one request did; all times in seconds on one monotonic clock."""

    start: float
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    success: bool = False
    error: str = ""

    @property
    def ttft(self) -> float:
        """Time to first token (s); 0 when no token arrived."""
        return self.token_times[0] - self.start if self.token_times else 0.0

    @property
    def e2el(self) -> float:
        """End-to-end latency (s)."""
        return self.end - self.start

    @property
    def tpot(self) -> float:
        """Time per output token after the first (s); 0 for one-token outputs."""
        if self.output_len <= 1:
            return 0.0
        return (self.e2el - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive token arrivals (s)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class ServeMetrics:
    """Aggregate serving metrics; latency stats are in milliseconds."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_concurrency: int
    latency_ms: dict[str, dict[str, float]]
    goodput: float | None = None
    slos_ms: dict[str, float] | None = None

    def to_dict(self) -> dict[str, object]:
        """Flat JSON-able form (``mean_ttft_ms``, ``p99_itl_ms``, ...)."""
        d: dict[str, object] = {
            k: v for k, v in self.__dict__.items() if k not in ("latency_ms",)
        }
        for metric, stats in self.latency_ms.items():
            for stat, value in stats.items():
                d[f"{stat}_{metric}_ms"] = value
        return d


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) with linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    rank = p / 100.0 * (len(s) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def _stats_ms(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    out = {
        "mean": statistics.fmean(ms) if ms else 0.0,
        "median": percentile(ms, 50),
        "std": statistics.pstdev(ms) if ms else 0.0,
    }
    for p in percentiles:
        out[f"p{p:g}"] = percentile(ms, p)
    return out


def peak_concurrency(intervals: Sequence[tuple[float, float]]) -> int:
    """Most intervals open at once; one ending when another starts does not overlap."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _meets_slos(rec: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    values = {"ttft": rec.ttft, "tpot": rec.tpot, "e2el": rec.e2el}
    return all(values[k] * 1000.0 <= v for k, v in slos_ms.items())


def compute_serve_metrics(
    records: Sequence[RequestRecord],
    duration_s: float | None = None,
    slos_ms: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = (99,),
) -> ServeMetrics:
    """Aggregate per-request records into :class:`ServeMetrics`.

    ``duration_s`` defaults to last end - first start. ``slos_ms`` (keys ``ttft``,
    ``tpot``, ``e2el``) enables goodput: successful requests meeting every SLO per s.
    """
    if slos_ms:
        unknown = set(slos_ms) - {"ttft", "tpot", "e2el"}
        if unknown:
            raise ValueError(f"unknown SLO metric(s): {sorted(unknown)}")
    ok = [r for r in records if r.success]
    if duration_s is None:
        duration_s = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0

    def rate(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.output_len > 1],
        "itl": [g for r in ok for g in r.itls],
        "e2el": [r.e2el for r in ok],
    }
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    goodput = None
    if slos_ms:
        goodput = rate(sum(1 for r in ok if _meets_slos(r, slos_ms)))
    return ServeMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=rate(len(ok)),
        output_throughput=rate(n_out),
        total_token_throughput=rate(n_in + n_out),
        peak_concurrency=peak_concurrency([(r.start, r.end) for r in records]),
        latency_ms={m: _stats_ms(values[m], percentiles) for m in METRICS},
        goodput=goodput,
        slos_ms=dict(slos_ms) if slos_ms else None,
    )

"""Serving load generator (``kvserve bench serve``) for an OpenAI-compatible server.

Sends ``POST /v1/completions`` with token-id prompts, greedy, ``ignore_eos`` and
streaming with usage; arrivals follow a seeded Poisson process at the request rate
(``inf``: all at once), at most ``max_concurrency`` in flight. Every request has a
timeout and nothing starts after ``max_duration_s``, so a run always ends by itself.
Only loopback base URLs are accepted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

from kvserve.bench.instruments.serve_metrics import RequestRecord, ServeMetrics, \
    compute_serve_metrics
from kvserve.bench.workloads.definitions import BenchRequest, poisson_arrival_times

__all__ = ["ServeResult", "check_loopback", "run_serve_benchmark", "run_serve", "parse_sse_line"]

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


@dataclass
class ServeResult:
    """A finished serving run: settings, per-request records and the metrics."""

    base_url: str
    model: str
    request_rate: float
    max_concurrency: int | None
    num_skipped: int
    metrics: ServeMetrics
    records: list[RequestRecord] = field(default_factory=list)

    def to_dict(self, detailed: bool = False) -> dict[str, Any]:
        """JSON-able summary (metrics flattened); ``detailed`` adds one entry per request.

        The per-request lists follow ``vllm bench serve --save-detailed``: lengths,
        ``ttfts`` and ``itls`` in seconds; plus ``request_errors`` and ``start_times`` (seconds
        after the first request was sent), in the order the requests were sent.
        """
        summary = {
            "base_url": self.base_url,
            "model": self.model,
            "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
            "max_concurrency": self.max_concurrency,
            "num_skipped": self.num_skipped,
            "errors": sorted({r.error for r in self.records if r.error})[:10],
            **self.metrics.to_dict(),
        }
        if detailed:
            first = min((r.start for r in self.records), default=0.0)
            summary.update(
                input_lens=[r.prompt_len for r in self.records],
                output_lens=[r.output_len for r in self.records],
                start_times=[r.start - first for r in self.records],
                ttfts=[r.ttft for r in self.records],
                itls=[r.itls for r in self.records],
                request_errors=[r.error for r in self.records])
        return summary


def check_loopback(base_url: str) -> str:
    """Return ``base_url`` without a trailing slash; raise unless its host is loopback."""
    parts = urlsplit(base_url)
    host = (parts.hostname or "").lower()
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                raise ValueError
        except ValueError:
            raise ValueError(f"bench serve only targets loopback servers, not {host!r}") from None
    return base_url.rstrip("/")


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """One SSE line: a JSON dict, ``"[DONE]"``, or None for anything else."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    return json.loads(data) if data else None


async def fetch_model_name(client: Any, base_url: str) -> str:
    """The first model id listed by ``GET /v1/models``."""
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def _stream_completion(
    client: Any, url: str, payload: dict[str, Any], rec: RequestRecord
) -> None:
    """Stream one completion into ``rec`` (token times, lengths, success)."""
    chunks = 0
    usage: dict[str, Any] = {}
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            rec.error = f"HTTP {resp.status_code}: {body[:200]}"
            return
        async for line in resp.aiter_lines():
            event = parse_sse_line(line)
            if event is None:
                continue
            if event == "[DONE]":
                rec.success = True
                break
            if "error" in event:
                rec.error = str(event["error"])[:200]
                return
            if event.get("choices"):
                rec.token_times.append(time.perf_counter())
                chunks += 1
            if event.get("usage"):
                usage = event["usage"]
    rec.output_len = int(usage.get("completion_tokens") or chunks)
    rec.prompt_len = int(usage.get("prompt_tokens") or rec.prompt_len)
    if not rec.success:
        rec.error = "stream ended without [DONE]"


async def send_request(
    client: Any, base_url: str, model: str, req: BenchRequest, timeout_s: float
) -> RequestRecord:
    """Send one streaming completion; never raises, failures land in the record."""
    payload = {
        "model": model,
        "prompt": list(req.prompt_token_ids),
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    rec = RequestRecord(start=time.perf_counter(), prompt_len=req.prompt_len)
    try:
        await asyncio.wait_for(
            _stream_completion(client, f"{base_url}/v1/completions", payload, rec), timeout_s
        )
    except asyncio.TimeoutError:
        rec.success, rec.error = False, f"timeout after {timeout_s:g}s"
    except Exception as exc:  # network errors, bad JSON: a failed request, not a crash
        rec.success, rec.error = False, f"{type(exc).__name__}: {exc}"[:200]
    rec.end = time.perf_counter()
    return rec


async def run_serve_benchmark(
    requests: Sequence[BenchRequest],
    base_url: str = DEFAULT_BASE_URL,
    model: str | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    timeout_s: float = 300.0,
    max_duration_s: float | None = None,
    seed: int = 0,
    slos_ms: Mapping[str, float] | None = None,
    transport: Any = None,
) -> ServeResult:
    """Run the load against ``base_url`` and compute the metrics.

    ``transport`` is passed to ``httpx.AsyncClient`` (tests use a mock transport).
    """
    import httpx

    base = check_loopback(base_url)
    arrivals = poisson_arrival_times(len(requests), request_rate, seed)
    conns = max_concurrency or max(1, len(requests))
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0))
    async with httpx.AsyncClient(
        transport=transport, timeout=timeout, limits=limits, trust_env=False
    ) as client:
        if model is None:
            model = await fetch_model_name(client, base)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        t0 = time.perf_counter()
        deadline = math.inf if max_duration_s is None else t0 + max_duration_s

        async def one(req: BenchRequest, at: float) -> RequestRecord | None:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                await sem.acquire()
            try:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return None
                return await send_request(client, base, model, req, min(timeout_s, left))
            finally:
                if sem is not None:
                    sem.release()

        results = await asyncio.gather(*(one(r, a) for r, a in zip(requests, arrivals)))
        duration = time.perf_counter() - t0
    records = [r for r in results if r is not None]
    metrics = compute_serve_metrics(records, duration_s=duration, slos_ms=slos_ms)
    return ServeResult(
        base_url=base,
        model=model,
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        num_skipped=len(results) - len(records),
        metrics=metrics,
        records=records,
    )


def run_serve(requests: Sequence[BenchRequest], **kwargs: Any) -> ServeResult:
    """Synchronous wrapper around :func:`run_serve_benchmark`."""
    return asyncio.run(run_serve_benchmark(requests, **kwargs))

"""GET /v1/stats and GET /dashboard on a real server: the live window, behind the API key."""
from __future__ import annotations

import time

import httpx

from tests.entrypoints.conftest import MODEL

KEYS = {"object", "time", "model", "uptime_s", "running", "waiting", "tokens_per_s", "ttft_ms",
        "tpot_ms", "kv", "prefix_cache", "preemptions", "kv_transfer", "step_time",
        "requests", "batch", "alerts", "history"}


def test_stats_follow_the_requests(server, client):
    before = httpx.get(f"{server.url}/v1/stats").json()
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="count: 1 2 3", max_tokens=24,
                                  temperature=0, extra_body={"ignore_eos": True})
    time.sleep(1.1)  # one more point of history
    stats = httpx.get(f"{server.url}/v1/stats").json()
    assert set(stats) == KEYS and stats["object"] == "kvserve.stats" and stats["model"] == MODEL
    assert stats["requests"]["finished"] >= before["requests"]["finished"] + 3
    assert stats["tokens_per_s"]["generation"] > 0
    assert stats["ttft_ms"]["p50"] > 0 and stats["tpot_ms"]["p99"] >= stats["tpot_ms"]["p50"]
    assert stats["kv"]["manager"] == "paged" and stats["kv"]["num_blocks"] > 0
    assert 0 <= stats["kv"]["usage"] <= 1
    assert stats["history"] and stats["history"][-1]["t"] <= stats["time"]
    assert stats["step_time"]["step_ms"] > 0  # one step in 16 is profiled
    shares = [stats["step_time"][p] for p in ("linear", "attention", "other")]
    assert abs(sum(shares) - 1) < 1e-6 and all(s >= 0 for s in shares)


def test_dashboard_page_is_served(server):
    r = httpx.get(f"{server.url}/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/stats" in r.text


def test_default_prefix_is_kvserve(server):
    text = httpx.get(f"{server.url}/metrics").text
    assert "kvserve:engine_healthy" in text and "vllm:" not in text

"""The serve load generator against fake OpenAI SSE servers (mock transport and a real
uvicorn server on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvserve.bench.instruments.serve import check_loopback, parse_sse_line, run_serve, \
    run_serve_benchmark
from kvserve.bench.workloads.definitions import BenchRequest

REQS = [BenchRequest([1, 2, 3], 4), BenchRequest([4, 5], 1), BenchRequest([6] * 7, 6)]


def _sse(body: dict[str, Any], with_usage: bool = True, done: bool = True) -> bytes:
    n = body["max_tokens"]
    lines = [f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}'}]})}\n\n" for i in range(n)]
    if with_usage:
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        lines.append(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n")
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def _transport(state: dict[str, Any], **sse_kw: Any) -> httpx.MockTransport:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        state.setdefault("bodies", []).append(body)
        state["live"] = state.get("live", 0) + 1
        state["peak"] = max(state.get("peak", 0), state["live"])
        await asyncio.sleep(0.005)
        state["live"] -= 1
        if body["max_tokens"] == 1 and state.get("fail_one"):
            return httpx.Response(500, json={"error": {"message": "nope"}})
        return httpx.Response(200, content=_sse(body, **sse_kw),
                              headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_mock_stream_parsing_and_counts() -> None:
    state: dict[str, Any] = {}
    res = run_serve(REQS, base_url="http://127.0.0.1:9", transport=_transport(state),
                    max_concurrency=2, request_rate=math.inf)
    assert res.model == "tiny"
    body = state["bodies"][0]
    assert body["model"] == "tiny" and body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert sorted(tuple(b["prompt"]) for b in state["bodies"]) == sorted(tuple(r.prompt_token_ids) for r in REQS)
    assert state["peak"] <= 2
    assert all(r.success for r in res.records)
    assert [r.output_len for r in res.records] == [4, 1, 6]
    assert [len(r.token_times) for r in res.records] == [4, 1, 6]
    assert [r.prompt_len for r in res.records] == [3, 2, 7]
    m = res.metrics
    assert m.completed == 3 and m.total_output_tokens == 11 and m.total_input_tokens == 12
    assert res.to_dict()["request_rate"] == "inf" and "ttfts" not in res.to_dict()
    detailed = res.to_dict(detailed=True)
    assert detailed["output_lens"] == [4, 1, 6] and detailed["input_lens"] == [3, 2, 7]
    assert detailed["ttfts"] == [r.ttft for r in res.records]
    assert [len(x) for x in detailed["itls"]] == [3, 0, 5]
    assert min(detailed["start_times"]) == 0.0 and detailed["request_errors"] == ["", "", ""]


def test_mock_failures() -> None:
    state: dict[str, Any] = {"fail_one": True}
    res = run_serve(REQS, base_url="http://localhost:9", model="m", transport=_transport(state))
    assert [r.success for r in res.records] == [True, False, True]
    assert "HTTP 500" in res.records[1].error
    assert res.metrics.failed == 1
    res = run_serve(REQS[:1], base_url="http://localhost:9", model="m",
                    transport=_transport({}, with_usage=False, done=False))
    rec = res.records[0]
    assert not rec.success and "[DONE]" in rec.error and rec.output_len == 4


def test_loopback_only() -> None:
    for url in ("http://127.0.0.1:8000/", "http://localhost:1", "http://[::1]:8000", "http://127.0.0.2"):
        assert check_loopback(url) == url.rstrip("/")
    for url in ("http://example.com:8000", "http://10.0.0.1", "ftp://127.0.0.1", "nonsense"):
        with pytest.raises(ValueError):
            check_loopback(url)
    with pytest.raises(ValueError):
        run_serve(REQS, base_url="http://192.168.1.1:8000", model="m")


def test_parse_sse_line() -> None:
    assert parse_sse_line("data: [DONE]") == "[DONE]"
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line(": keep-alive") is None and parse_sse_line("") is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_uvicorn_server() -> None:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()

        async def gen():
            for chunk in _sse(body).split(b"\n\n"):
                if chunk:
                    await asyncio.sleep(0.002)
                    yield chunk + b"\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started
        res = asyncio.run(run_serve_benchmark(REQS, base_url=f"http://127.0.0.1:{port}",
                                              request_rate=50.0, timeout_s=20))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert res.model == "fake"
    assert [r.output_len for r in res.records] == [4, 1, 6]
    assert all(r.success for r in res.records)
    m = res.metrics
    assert m.completed == 3 and m.total_output_tokens == 11
    assert len([g for r in res.records for g in r.itls]) == 3 + 0 + 5
    assert m.latency_ms["ttft"]["mean"] > 0

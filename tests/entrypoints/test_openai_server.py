"""The OpenAI-compatible server, driven as a real process with the official openai client."""
from __future__ import annotations

import asyncio
import json
import re
import time

from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.conftest import MODEL

REQUIRED_METRICS = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
    "request_success_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "kv_transfer_bytes_total",
    "kv_transfer_seconds_total", "kv_cache_utilization_perc", "kv_cache_fragmentation_perc"]


def _count_tokens(server, text: str) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text})
    return r.json()["count"]


# -- the happy paths -------------------------------------------------------------------

def test_models_and_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = httpx.get(f"{server.url}/v1/models").json()
    assert raw["object"] == "list"
    card = raw["data"][0]
    assert {"id", "object", "created", "owned_by", "max_model_len"} <= set(card)
    assert card["object"] == "model" and card["owned_by"] == "kvserve"
    assert card["max_model_len"] == 512
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completions_n2_logprobs(server, client):
    prompt = "def split(self, text):"
    r = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=6,
                                  logprobs=3, temperature=0.8, seed=7)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert sorted(c.index for c in r.choices) == [0, 1]
    n_prompt = _count_tokens(server, prompt)
    assert r.usage.prompt_tokens == n_prompt  # once per prompt, not x n
    total = 0
    for c in r.choices:
        assert c.finish_reason in ("stop", "length")
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) \
            == len(lp.text_offset) >= 1
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(1 <= len(t) <= 4 for t in lp.top_logprobs)  # top 3 (+ the sampled one)
        assert lp.text_offset == sorted(lp.text_offset)
        total += len(lp.tokens)
    assert r.usage.completion_tokens == total
    assert r.usage.total_tokens == n_prompt + total


def test_completions_batch_echo_and_token_ids(server, client):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "import os"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], n=2, max_tokens=4,
                                  temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c for c in r.choices}
    assert by_index[0].text == by_index[1].text  # greedy: both samples alike
    assert by_index[0].text.startswith("import os")
    assert r.usage.prompt_tokens == len(ids) + 2
    assert r.usage.completion_tokens == 16  # 4 choices x 4 tokens (ignore_eos: all run to length)


def test_streaming_matches_non_streaming_with_stop(server, client):
    kwargs = dict(model=MODEL, prompt="class Template:", max_tokens=40, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) > 6
    stop = full[4:7]  # a stop string in the middle of the greedy text
    want = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert want.finish_reason == "stop" and want.text == full[:full.index(stop)]
    pieces, reasons = [], []
    for chunk in client.completions.create(**kwargs, stop=[stop], stream=True):
        for c in chunk.choices:
            pieces.append(c.text)
            reasons.append(c.finish_reason)
    assert "".join(pieces) == want.text  # never streamed past / into the stop string
    assert reasons[-1] == "stop"


def test_chat(server, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.bytes is not None for t in content)
    tok = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    assert r.usage.prompt_tokens == tok["count"]
    # max_completion_tokens wins over max_tokens
    r2 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9,
                                        max_completion_tokens=2, temperature=0)
    assert r2.usage.completion_tokens <= 2


def test_chat_streaming_with_usage(server, client):
    messages = [{"role": "user", "content": "write a loop"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                          temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices
              and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_raw_sse_ends_with_done(server):
    body = {"model": MODEL, "prompt": "x = ", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_tokenize_round_trip(server):
    text = "def wrap(text, width=70, **kwargs):\n    return text"
    tok = httpx.post(f"{server.url}/tokenize",
                     json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 3 and tok["max_model_len"] == 512
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == text
    with_bos = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()
    assert with_bos["count"] == tok["count"] + 1  # the tokenizer adds <|bos|>


# -- load, disconnects, metrics ---------------------------------------------------------------

def test_64_concurrent_streams(server):
    prompts = [f"def f{i}(x):" for i in range(64)]
    counts = {p: _count_tokens(server, p) for p in prompts}

    async def one(client, i, prompt):
        max_tokens = 8 + i % 8
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.7, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        reasons, usage = [], None
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage or usage
        return prompt, max_tokens, reasons, usage

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    for prompt, max_tokens, reasons, usage in results:
        assert reasons == ["length"]
        assert usage.completion_tokens == max_tokens
        assert usage.prompt_tokens == counts[prompt]
        assert usage.total_tokens == max_tokens + counts[prompt]


def test_16_cut_streams_free_everything(server):
    before = server.metrics().get('kvserve:request_success_total{finished_reason="abort"}', 0)
    body = {"model": MODEL, "prompt": "while True:", "max_tokens": 400, "stream": True,
            "ignore_eos": True}

    async def cut(client):
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    return  # leaving the block closes the connection mid-stream

    async def give_up(client) -> int:
        """A non-streamed request whose client leaves once the server runs it; 0 if it
        finished first (a very fast machine)."""
        post = asyncio.ensure_future(client.post(
            f"{server.url}/v1/completions", json={**body, "stream": False, "max_tokens": 480}))
        while not post.done():
            m = (await client.get(f"{server.url}/metrics")).text
            if re.search(r"^kvserve:num_requests_running(\{[^}]*\})? [1-9]", m, re.M):
                break
            await asyncio.sleep(0.005)
        if post.done():
            return 0
        post.cancel()  # closes its connection
        await asyncio.gather(post, return_exceptions=True)
        return 1

    async def run_all():
        async with httpx.AsyncClient(timeout=60) as client:
            first = await give_up(client)
            return [first, *await asyncio.gather(*(cut(client) for _ in range(16)))]

    gave_up = asyncio.run(run_all())[0]
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        done = (m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
                and m["kvserve:kv_cache_usage_perc"] == 0)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert done, m
    aborted = m['kvserve:request_success_total{finished_reason="abort"}'] - before
    assert aborted == 16 + gave_up


def test_metrics_and_stats_log(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in REQUIRED_METRICS:
        assert f"kvserve:{name}" in text, name
    m = server.metrics()
    assert m["kvserve:prompt_tokens_total"] > 0 and m["kvserve:generation_tokens_total"] > 0
    assert m['kvserve:request_success_total{finished_reason="length"}'] >= 64
    assert m["kvserve:time_to_first_token_seconds_count"] >= 64
    assert m["kvserve:e2e_request_latency_seconds_count"] >= 64
    assert m["kvserve:inter_token_latency_seconds_count"] > 0
    assert m["kvserve:prefix_cache_queries_total"] >= m["kvserve:prompt_tokens_total"] > 0
    info = [line for line in text.splitlines() if line.startswith("kvserve:cache_config_info{")]
    assert len(info) == 1 and info[0].endswith(" 1.0")
    assert 'cache_dtype="float32"' in info[0] and 'block_size="16"' in info[0]
    deadline = time.monotonic() + 5
    while "Avg generation throughput" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "Avg prompt throughput" in server.log()


# -- auth, limits, backpressure, shutdown (the strict server) ----------------------------

def test_api_key(strict_server):
    url = f"{strict_server.url}/v1/models"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
        r = httpx.get(url, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(url, headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 200
    assert r.json()["data"][0]["id"] == Path(strict_server.model_dir).name  # default name
    assert httpx.get(f"{strict_server.url}/health").status_code == 200  # not protected
    with openai.OpenAI(base_url=f"{strict_server.url}/v1", api_key="bad", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()


def test_body_limit(strict_server):
    r = httpx.post(f"{strict_server.url}/v1/completions", json={"prompt": "y" * 3000},
                   headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 413 and r.json()["error"]["message"]


def test_backpressure_429(strict_server):
    """One sequence runs, one waits (--max-waiting 1): the next request gets 429."""
    headers = {"Authorization": "Bearer sesame"}
    body = {"prompt": "for i in range(10):", "max_tokens": 480, "stream": True,
            "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=strict_server.url, headers=headers,
                                     timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=body) as first:
                lines = first.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass  # the first is running now
                async with client.stream("POST", "/v1/completions", json=body) as second:
                    assert second.status_code == 200  # accepted, waiting
                    third = await client.post("/v1/completions", json={**body, "stream": False})
                    for _ in range(40):  # the gauge follows the engine's next published step
                        waiting = strict_server.metrics()["kvserve:num_requests_waiting"]
                        if waiting == 1:
                            break
                        await asyncio.sleep(0.05)
                # the second left while still waiting: it leaves the queue at once
                for _ in range(100):
                    if strict_server.metrics()["kvserve:num_requests_waiting"] == 0:
                        break
                    await asyncio.sleep(0.05)
                return third, waiting, strict_server.metrics()["kvserve:num_requests_waiting"]
    third, waiting_before, waiting_after = asyncio.run(run())
    assert third.status_code == 429, third.text
    assert (waiting_before, waiting_after) == (1, 0)
    assert third.json()["error"]["code"] == "rate_limit_exceeded"
    deadline = time.monotonic() + 10
    while strict_server.metrics()["kvserve:kv_cache_usage_perc"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_sigterm_finishes_in_flight_and_exits_0(strict_server):
    headers = {"Authorization": "Bearer sesame"}
    body = {"prompt": "x", "max_tokens": 60, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", f"{strict_server.url}/v1/completions", json=body,
                      headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    strict_server.proc.terminate()  # SIGTERM mid-stream
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 60  # finished, not cut
    assert strict_server.proc.wait(30) == 0
    assert "Shutting down" in strict_server.log()

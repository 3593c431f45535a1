"""Client-side helpers for the Batch API tests: JSONL lines, uploads, waiting."""
from __future__ import annotations

import json
import time

import openai

MODEL = "llama"
TERMINAL = ("completed", "failed", "cancelled", "expired")


def jsonl(rows) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def line(custom_id: str, body: dict, url: str = "/v1/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def completion_body(i: int, max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "prompt": f"def f{i}(x): return", "max_tokens": max_tokens,
            "temperature": 0, **extra}


def wait_batch(client: openai.OpenAI, batch_id: str, timeout: float = 30.0, until=TERMINAL):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.05)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(r) for r in client.files.content(file_id).text.splitlines() if r]


def upload(client: openai.OpenAI, rows, name: str = "input.jsonl"):
    return client.files.create(file=(name, jsonl(rows)), purpose="batch")


def make_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)

"""What the router matches on: a request's prompt, read from its body without tokenizing.

Completions route on the prompt as sent (a string's characters, or the token ids);
chat routes on its messages' roles and text in order. Both are what the replica will
put first in the sequence it caches, so equal leading parts mean shared KV blocks. A
body that is not a request the router understands routes with an empty key (least
loaded), and the replica then answers it as the single server would.
"""
from __future__ import annotations

import json
from typing import Sequence

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


def routing_prompt(path: str, body: bytes) -> Sequence:
    if path not in ROUTED_PATHS:
        return ()
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            return ()
        if path == "/v1/completions":
            return _completion_prompt(data.get("prompt"))
        return _chat_prompt(data.get("messages"))
    except Exception:  # noqa: BLE001 - whatever the body is, the replica answers it
        return ()


def _completion_prompt(prompt) -> Sequence:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return tuple(prompt)
        return _completion_prompt(prompt[0])  # a batch of prompts: route on the first
    return ()


def _chat_prompt(messages) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            return ""
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p["text"] for p in content
                              if isinstance(p, dict) and isinstance(p.get("text"), str))
        parts.append(f"{m.get('role')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)

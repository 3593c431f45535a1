"""Bad requests get a clear OpenAI-shaped error naming what is wrong, and the server
keeps serving."""
from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import MODEL

_C, _CHAT = "/v1/completions", "/v1/chat/completions"
_MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (id, path, json body or raw bytes, headers, expected status)
    ("malformed-json", _C, b'{"prompt": "x",', None, 400),
    ("invalid-utf8", _C, b'{"prompt": "\xff\xfe"}', None, 400),
    ("not-an-object", _C, b"[1, 2]", None, 400),
    ("empty-body", _C, b"", None, 400),
    ("wrong-content-type", _C, b'{"prompt": "x"}', {"content-type": "text/plain"}, 415),
    ("missing-prompt", _C, {"model": MODEL}, None, 400),
    ("prompt-wrong-type", _C, {"prompt": 5}, None, 400),
    ("prompt-empty-string", _C, {"prompt": ""}, None, 400),
    ("prompt-empty-list", _C, {"prompt": []}, None, 400),
    ("prompt-token-out-of-vocab", _C, {"prompt": [3, 999999]}, None, 400),
    ("prompt-negative-token", _C, {"prompt": [-1]}, None, 400),
    ("prompt-too-long", _C, {"prompt": [5] * 600}, None, 400),
    ("max-tokens-negative", _C, {"prompt": "x", "max_tokens": -1}, None, 400),
    ("max-tokens-string", _C, {"prompt": "x", "max_tokens": "ten"}, None, 400),
    ("max-tokens-huge", _C, {"prompt": "x", "max_tokens": 10**9}, None, 400),
    ("temperature-negative", _C, {"prompt": "x", "temperature": -1}, None, 400),
    ("temperature-nan", _C, b'{"prompt": "x", "temperature": NaN}', None, 400),
    ("top-p-zero", _C, {"prompt": "x", "top_p": 0}, None, 400),
    ("top-p-above-one", _C, {"prompt": "x", "top_p": 1.5}, None, 400),
    ("top-k-below-minus-one", _C, {"prompt": "x", "top_k": -5}, None, 400),
    ("n-zero", _C, {"prompt": "x", "n": 0}, None, 400),
    ("n-huge", _C, {"prompt": "x", "n": 100000}, None, 400),
    ("stop-50-strings", _C, {"prompt": "x", "stop": [f"s{i}" for i in range(50)]}, None, 400),
    ("stop-wrong-type", _C, {"prompt": "x", "stop": 3}, None, 400),
    ("logprobs-too-many", _C, {"prompt": "x", "logprobs": 50}, None, 400),
    ("presence-penalty-range", _C, {"prompt": "x", "presence_penalty": 5}, None, 400),
    ("repetition-penalty-zero", _C, {"prompt": "x", "repetition_penalty": 0}, None, 400),
    ("min-tokens-over-max", _C, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, None, 400),
    ("stop-token-ids-negative", _C, {"prompt": "x", "stop_token_ids": [-5]}, None, 400),
    ("seed-string", _C, {"prompt": "x", "seed": "abc"}, None, 400),
    ("stream-not-bool", _C, {"prompt": "x", "stream": "yes"}, None, 400),
    ("logit-bias-not-a-token", _C, {"prompt": "x", "logit_bias": {"five": 1.0}}, None, 400),
    ("logit-bias-out-of-vocab", _C, {"prompt": "x", "logit_bias": {"99999": 1.0}}, None, 400),
    ("logit-bias-too-big", _C, {"prompt": "x", "logit_bias": {"5": 101}}, None, 400),
    ("unknown-field", _C, {"prompt": "x", "temprature": 0.5}, None, 400),
    ("response-format-type", _CHAT, {"messages": _MSG, "response_format": {"type": "xml"}},
     None, 400),
    ("tools", _CHAT, {"messages": _MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {}}}]}, None, 400),
    ("guided-json-not-json", _C, {"prompt": "x", "guided_json": "{not json"}, None, 400),
    ("chat-echo", _CHAT, {"messages": _MSG, "echo": True}, None, 400),
    ("nested-unknown", _CHAT, {"messages": [{"role": "user", "content": "x", "mood": 1}]},
     None, 400),
    ("image-part", _CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, None, 400),
    ("truncate-zero", _C, {"prompt": "x", "truncate_prompt_tokens": 0}, None, 400),
    ("bad-words-blank", _C, {"prompt": "x", "bad_words": [" "]}, None, 400),
    ("unknown-model", _C, {"model": "gpt-17", "prompt": "x"}, None, 404),
    ("body-too-large", _C, {"prompt": "x" * 1_100_000}, None, 413),
    ("chat-messages-not-list", _CHAT, {"messages": "hello"}, None, 400),
    ("chat-messages-empty", _CHAT, {"messages": []}, None, 400),
    ("chat-unknown-role", _CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None, 400),
    ("chat-missing-role", _CHAT, {"messages": [{"content": "x"}]}, None, 400),
    ("chat-content-wrong-type", _CHAT, {"messages": [{"role": "user", "content": 3}]}, None,
     400),
    ("chat-top-logprobs-without-logprobs", _CHAT, {"messages": _MSG, "top_logprobs": 2}, None,
     400),
    ("chat-max-completion-tokens-zero", _CHAT, {"messages": _MSG, "max_completion_tokens": 0},
     None, 400),
    ("chat-prompt-too-long", _CHAT,
     {"messages": [{"role": "user", "content": "qz " * 900}]}, None, 400),
    ("chat-unknown-model", _CHAT, {"model": "nope", "messages": _MSG}, None, 404),
    ("tokenize-nothing", "/tokenize", {"add_special_tokens": True}, None, 400),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [1, 10**7]}, None, 400),
    ("unknown-route", "/v1/nothing-here", {"x": 1}, None, 404),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(server, case):
    _, path, body, headers, status = case
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = headers or ({"content-type": "application/json"} if isinstance(body, bytes)
                          else None)
    r = httpx.post(f"{server.url}{path}", headers=headers, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if case[0] == "prompt-too-long":
        assert "600" in err["message"] and "512" in err["message"]
    if status == 404 and "model" in case[0]:
        assert err["code"] == "model_not_found" and err["param"] == "model"
    named = {"unknown-field": "temprature", "response-format-type": "response_format",
             "tools": "tools", "guided-json-not-json": "json", "chat-echo": "echo",
             "nested-unknown": "messages.0.mood", "logit-bias-out-of-vocab": "logit_bias",
             "logit-bias-too-big": "logit_bias", "logit-bias-not-a-token": "logit_bias",
             "truncate-zero": "truncate_prompt_tokens", "bad-words-blank": "bad_words"}
    if case[0] in named:
        assert named[case[0]] in err["message"], err
    if case[0] == "unknown-field":
        assert err["message"] == "Unrecognized request argument supplied: temprature"
        assert err["param"] == "temprature"


def test_accepted_fields_that_change_nothing(server):
    r = httpx.post(f"{server.url}{_CHAT}", timeout=30, json={
        "messages": _MSG, "max_tokens": 2, "user": "someone", "metadata": {"team": "a"}})
    assert r.status_code == 200, r.text


def test_logit_bias_steers_greedy_decoding(server, client):
    forced = client.completions.create(model=MODEL, prompt="hello", max_tokens=4,
                                       temperature=0, logit_bias={"77": 100})
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [77] * 4})
    assert forced.choices[0].text == r.json()["prompt"]

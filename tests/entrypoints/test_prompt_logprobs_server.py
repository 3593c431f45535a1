"""Scoring text through /v1/completions, as evaluation harnesses do: echo with logprobs
(and max_tokens 0) returns every prompt token's logprob, equal to transformers'."""
from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import MODEL
from tests.engine.test_prompt_logprobs import hf_prompt_logprobs
from tests.helpers import prompts_of_lengths

PROMPT = prompts_of_lengths([14], seed=7)[0]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_logprobs_score_the_prompt(client, llama_dir, max_tokens):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                    temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(PROMPT) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = hf_prompt_logprobs(llama_dir, PROMPT)
    for pos in range(1, len(PROMPT)):
        assert lp.token_logprobs[pos] == pytest.approx(
            float(expected[pos - 1, PROMPT[pos]]), abs=1e-4)
        assert lp.top_logprobs[pos]  # (tokens that decode alike share one text key)
    assert out.usage.completion_tokens == max_tokens
    if max_tokens == 0:
        assert out.choices[0].finish_reason == "length"


def test_vllm_prompt_logprobs_field_and_stream(client, server, llama_dir):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 1})
    entries = out.model_extra.get("prompt_logprobs") or out.choices[0].model_extra[
        "prompt_logprobs"]
    expected = hf_prompt_logprobs(llama_dir, PROMPT)
    assert entries[0] is None and len(entries) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        own = entries[pos][str(PROMPT[pos])]
        assert own["logprob"] == pytest.approx(float(expected[pos - 1, PROMPT[pos]]), abs=1e-4)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                            temperature=0, echo=True, logprobs=0,
                                            stream=True))
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None
    assert first.token_logprobs[1] == pytest.approx(float(expected[0, PROMPT[1]]), abs=1e-4)


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "max_tokens": 0}, "needs echo=true"),
    ({"prompt": "x", "max_tokens": 0, "echo": True, "stream": True}, "no stream"),
])
def test_scoring_misuse_is_refused(server, body, message):
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_chat_prompt_logprobs_refused_naming_where_it_is(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1})
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]


def test_chat_top_logprobs_20_match_transformers(client, server, llama_dir):
    from tests.helpers import hf_logprobs
    messages = [{"role": "user", "content": "hello there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                         temperature=0, logprobs=True, top_logprobs=20)
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 20 for t in content)
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    first = hf_logprobs(llama_dir, prompt, [0])[0]  # the first step's distribution
    top = first.topk(20).values.tolist()
    assert [t.logprob for t in content[0].top_logprobs] == pytest.approx(top, abs=1e-4)
    assert content[0].logprob == pytest.approx(top[0], abs=1e-4)  # greedy: the best one

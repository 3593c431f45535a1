"""vLLM's request extras through the server: truncate_prompt_tokens, bad_words,
stream_options.continuous_usage_stats, /tokenize's token_strs, the chat template's
continue_final_message and chat_template_kwargs."""
from __future__ import annotations

import httpx

from tests.entrypoints.conftest import MODEL
from tests.helpers import prompts_of_lengths


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    long = prompts_of_lengths([600], seed=2)[0]  # longer than max_model_len 512
    out = client.completions.create(model=MODEL, prompt=long, max_tokens=3, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 100})
    same = client.completions.create(model=MODEL, prompt=long[-100:], max_tokens=3,
                                     temperature=0)
    assert out.usage.prompt_tokens == 100 and out.choices[0].text == same.choices[0].text


def test_bad_words_are_never_generated(client, server):
    base = client.completions.create(model=MODEL, prompt="the", max_tokens=12, temperature=0)
    words = [w for w in base.choices[0].text.split() if w.strip()][:2]
    assert words, base.choices[0].text
    banned = client.completions.create(model=MODEL, prompt="the", max_tokens=12,
                                       temperature=0, extra_body={"bad_words": words})
    ids = httpx.post(f"{server.url}/tokenize", json={
        "prompt": banned.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    for word in words:
        for text in (word, " " + word):
            seq = httpx.post(f"{server.url}/tokenize", json={
                "prompt": text, "add_special_tokens": False}).json()["tokens"]
            if len(seq) == 1:
                assert seq[0] not in ids, (word, banned.choices[0].text)


def test_continuous_usage_stats_count_as_the_stream_goes(client):
    for create, kwargs in ((client.completions.create, {"prompt": "hello"}),
                           (client.chat.completions.create,
                            {"messages": [{"role": "user", "content": "hello"}]})):
        chunks = list(create(model=MODEL, max_tokens=6, temperature=0, stream=True,
                             stream_options={"include_usage": True,
                                             "continuous_usage_stats": True}, **kwargs))
        counted = [c.usage.completion_tokens for c in chunks if c.usage and c.choices]
        assert counted == sorted(counted) and counted[-1] == 6, counted
        assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_tokenize_returns_token_strings_when_asked(server):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world",
                                                    "return_token_strs": True}).json()
    assert len(r["token_strs"]) == len(r["tokens"]) and all(r["token_strs"])
    plain = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert plain["token_strs"] is None


def test_truncating_a_prompt_of_invalid_token_ids_is_a_400(server):
    """Found by fuzzing: the cut prompt was decoded before its ids were checked (500)."""
    r = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "prompt": [-283, 53874, -1547], "truncate_prompt_tokens": 2})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]


def test_chat_continues_the_final_message_and_names_bad_template_fields(server):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the"}]
    url = f"{server.url}/v1/chat/completions"
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
    ok = httpx.post(url, json={**body, "continue_final_message": True,
                               "add_generation_prompt": False}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    both = httpx.post(url, json={**body, "continue_final_message": True}, timeout=60)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    shadow = httpx.post(url, json={**body, "chat_template_kwargs": {"messages": []}},
                        timeout=60)
    assert shadow.status_code == 400 and shadow.json()["error"]["param"] == \
        "chat_template_kwargs"
    extra = httpx.post(url, json={**body, "chat_template_kwargs": {"enable_thinking": False},
                                  "documents": [{"title": "t", "text": "x"}]}, timeout=60)
    assert extra.status_code == 200

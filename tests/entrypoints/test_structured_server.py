"""Structured outputs through the OpenAI routes with the official client: response_format,
vLLM's structured_outputs and the older guided_* fields; bad grammars are 400s."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.entrypoints.conftest import MODEL

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
MSG = [{"role": "user", "content": "give me json"}]


def test_response_format_json_schema_and_json_object(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}})
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    else:  # cut by max_tokens: still a prefix of valid JSON
        assert choice.message.content.startswith("{")
    anyobj = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=60,
                                            temperature=0,
                                            response_format={"type": "json_object"})
    assert anyobj.choices[0].message.content.startswith("{")
    text = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content is not None


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: len(t) == 4 and t.isdigit()),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_regex": "(ab)+c"}, lambda t: t.endswith("c") and set(t) <= set("abc")),
])
def test_vllm_forms_constrain_completions(client, extra, check):
    out = client.completions.create(model=MODEL, prompt="pick:", max_tokens=20,
                                    temperature=1.0, n=3, seed=1, extra_body=extra)
    for c in out.choices:
        assert c.finish_reason == "stop" and check(c.text), c.text


@pytest.mark.parametrize("body, message", [
    ({"guided_regex": "[oops"}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "one output constraint"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "json_schema.schema"),
    ({"structured_outputs": {"choice": []}}, "choice"),
])
def test_bad_constraints_are_400s_and_the_server_goes_on(server, client, body, message):
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"prompt": "x", "max_tokens": 5, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices


def test_streamed_constrained_chat_matches_the_whole_answer(client):
    kwargs = dict(model=MODEL, messages=MSG, max_tokens=40, temperature=0,
                  extra_body={"guided_json": SCHEMA})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == whole and whole.startswith("{")

"""POST /v1/responses with the official client: text, instructions, streamed typed events
that add up to the whole response, function calls, JSON output, a conversation carrying
earlier calls and their outputs, and what needs a stored response refused by name."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.entrypoints.conftest import MODEL
from tests.entrypoints.test_tools_server import SHORT_TOOLS

FUNCTIONS = [{"type": "function", **t["function"]} for t in SHORT_TOOLS]


def _chat_text(client, messages, max_tokens):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=max_tokens).choices[0].message.content


def test_text_and_instructions_are_the_chat_answer(client):
    out = client.responses.create(model=MODEL, input="def add(a, b):", temperature=0,
                                  max_output_tokens=10)
    assert out.status in ("completed", "incomplete") and out.output[0].type == "message"
    assert out.output_text == _chat_text(client, [{"role": "user",
                                                   "content": "def add(a, b):"}], 10)
    assert out.usage.output_tokens == 10 and out.incomplete_details.reason == "max_output_tokens"
    with_instructions = client.responses.create(
        model=MODEL, instructions="Answer in Python.", temperature=0, max_output_tokens=10,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "reverse a list"}]}])
    assert with_instructions.output_text == _chat_text(client, [
        {"role": "system", "content": "Answer in Python."},
        {"role": "user", "content": "reverse a list"}], 10)


def test_streamed_events_add_up_to_the_whole_response(client):
    body = dict(model=MODEL, input="import os\n", temperature=0, max_output_tokens=12)
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # max_output_tokens reached
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_function_calls_whole_and_streamed(client):
    body = dict(model=MODEL, input="weather in Oslo?", tools=FUNCTIONS, temperature=0,
                tool_choice="required", parallel_tool_calls=False, max_output_tokens=100)
    whole = client.responses.create(**body)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_")
    params = next(f["parameters"] for f in FUNCTIONS if f["name"] == calls[0].name)
    jsonschema.validate(json.loads(calls[0].arguments), params)
    events = list(client.responses.create(**body, stream=True))
    pieces = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    final = events[-1].response
    assert pieces == calls[0].arguments == final.output[-1].arguments
    # the call and its output go back as input
    follow = client.responses.create(model=MODEL, tools=FUNCTIONS, max_output_tokens=5,
                                     input=[{"role": "user", "content": "weather in Oslo?"},
                                            {"type": "function_call", "call_id": "call_1",
                                             "name": calls[0].name,
                                             "arguments": calls[0].arguments},
                                            {"type": "function_call_output",
                                             "call_id": "call_1", "output": "rain"}],
                                     tool_choice="none")
    assert follow.output and follow.output[0].type == "message"


def test_a_json_schema_format_gives_valid_json(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    out = client.responses.create(model=MODEL, input="a number", max_output_tokens=40,
                                  text={"format": {"type": "json_schema", "name": "n",
                                                   "schema": schema}})
    jsonschema.validate(json.loads(out.output_text), schema)


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"modalities": ["text"]}, "modalities"),
    ({"text": {"verbosity": "low"}}, "text"),
])
def test_what_needs_a_stored_response_or_is_not_implemented_is_refused(server, extra, param):
    r = httpx.post(f"{server.url}/v1/responses", timeout=30,
                   json={"input": "hi", "max_output_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in (error.get("param") or "") + error["message"], error

"""Tool calling through /v1/chat/completions with the official client."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.entrypoints.conftest import MODEL
from tests.entrypoints.test_tool_parsers import TIME, WEATHER

TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
MSG = [{"role": "user", "content": "weather in Oslo?"}]
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}


def _check_calls(message):
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choice_give_valid_calls(client):
    out = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS,
                                         tool_choice="required", max_tokens=80, temperature=0,
                                         parallel_tool_calls=False)
    assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
    _check_calls(out.choices[0].message)
    named = client.chat.completions.create(
        model=MODEL, messages=MSG, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].finish_reason == "tool_calls", named.choices[0]
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_weather"]
    _check_calls(named.choices[0].message)


def test_streamed_tool_calls_arrive_as_delta_tool_calls(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=80,
        temperature=0, stream=True, parallel_tool_calls=False))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name in SCHEMAS
    assert json.loads(calls[0].function.arguments) is not None
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_conversation_with_tool_results_goes_back_through_the_template(client):
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 7 C"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=5)
    assert out.choices[0].message.tool_calls in (None, [])


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "chat template does not show it tools"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "distinct function names"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
])
def test_inconsistent_tool_requests_are_400s(server, body, message):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"messages": MSG, "max_tokens": 5, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text

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


def assembled(stream):
    """A streamed chat as the official client assembles it: (message, finish_reason, how
    many chunks carried tool-call pieces)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state, pieces = ChatCompletionStreamState(), 0
    for chunk in stream:
        state.handle_chunk(chunk)
        pieces += bool(chunk.choices and chunk.choices[0].delta.tool_calls)
    choice = state.get_final_completion().choices[0]
    return choice.message, choice.finish_reason, pieces


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_streamed_tool_calls_assemble_into_the_whole_answers_calls(client):
    body = dict(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                max_tokens=80, temperature=0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**body).choices[0]
    message, reason, pieces = assembled(client.chat.completions.create(**body, stream=True))
    assert reason == whole.finish_reason == "tool_calls"
    assert calls_of(message) == calls_of(whole.message) and calls_of(message)
    assert all(c.id.startswith("call_") for c in message.tool_calls)
    assert pieces > 1  # the arguments came in pieces, not one chunk at the end


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


# Qwen's tool-calling template in short: the tools in <tools></tools> in the system turn,
# calls as hermes <tool_call> blocks
HERMES_TEMPLATE = (
    "{% if tools %}<|user|>\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools>\nAnswer with <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>.\n{% endif %}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] or '' }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
    "{% endif %}")


# bounded arguments, so that a random model's call ends within the tokens it has
SHORT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]


def test_a_qwen3_model_with_a_hermes_template_streams_the_calls_it_answers_whole(
        model_dirs, tmp_path):
    from openai import OpenAI

    from tests.entrypoints.conftest import ServerProcess
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    server = ServerProcess(model_dirs("qwen3"), tmp_path / "log", "--chat-template",
                           str(template), "--tool-call-parser", "hermes")
    try:
        server.wait_healthy()
        client = OpenAI(base_url=f"{server.url}/v1", api_key="x")
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            body = dict(messages=MSG, tools=SHORT_TOOLS, tool_choice=choice, max_tokens=100,
                        temperature=0, parallel_tool_calls=False,
                        model=client.models.list().data[0].id)
            whole = client.chat.completions.create(**body).choices[0]
            message, reason, _ = assembled(client.chat.completions.create(**body, stream=True))
            assert reason == whole.finish_reason == "tool_calls"
            assert calls_of(message) == calls_of(whole.message) and calls_of(message)
            for call in message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), next(
                    t["function"]["parameters"] for t in SHORT_TOOLS
                    if t["function"]["name"] == call.function.name))
        auto = client.chat.completions.create(messages=MSG, tools=TOOLS, max_tokens=5,
                                              model=body["model"])  # the template shows tools
        assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")
    finally:
        server.terminate()


def test_auto_tool_choice_can_be_switched_off():
    from types import SimpleNamespace

    from kvserve.entrypoints.openai.errors import APIError
    from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
    from kvserve.entrypoints.openai.tools import plan_tools

    req = ChatCompletionRequest(messages=MSG, tools=TOOLS)
    shows = SimpleNamespace(renders_tools=lambda template=None: True)
    assert plan_tools(req, shows).forced == []
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        plan_tools(req, shows, auto=False)

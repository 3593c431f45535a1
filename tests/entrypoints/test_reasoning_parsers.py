"""--reasoning-parser: a reasoning model's answer split into reasoning_content and
content, whole and streamed (tags split across chunks held back, never shown), for the
qwen3 and deepseek_r1 conventions; an output constraint binds the answer after the
thinking."""
from __future__ import annotations

import pytest

from kvserve.entrypoints.openai import serving_chat
from kvserve.entrypoints.openai.context import ServerContext
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
from kvserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from kvserve.outputs import CompletionOutput, RequestOutput
from tests.entrypoints.test_stream_chunks import Stream, StubEngine, _collect

ANSWER = "<think>\nadd them</think>\n\nIt is 4."


@pytest.mark.parametrize("name, text, want", [
    ("qwen3", ANSWER, ("\nadd them", "\n\nIt is 4.")),
    ("qwen3", "It is 4.", (None, "It is 4.")),            # thinking off: all reply
    ("qwen3", "<think>still going", ("still going", None)),  # cut off while thinking
    ("deepseek_r1", "add them</think>It is 4.", ("add them", "It is 4.")),
    ("deepseek_r1", ANSWER, ("\nadd them", "\n\nIt is 4.")),
    ("deepseek_r1", "still going", ("still going", None)),
])
def test_whole_answers_split(name, text, want):
    assert REASONING_PARSERS[name]().split(text) == want


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streamed_in_any_pieces_it_adds_up_and_shows_no_tag(name, size):
    stream = REASONING_PARSERS[name]().stream()
    reasoning = content = ""
    for i in range(0, len(ANSWER), size):
        r, c = stream.feed(ANSWER[i:i + size])
        assert "think>" not in r + c
        reasoning, content = reasoning + r, content + c
    r, c = stream.feed("", final=True)
    assert (reasoning + r, content + c) == ("\nadd them", "\n\nIt is 4.")


class ThinkingEngine(StubEngine):
    async def stream_outputs(self, stream):
        for end in (2, 9, 15, 20, len(ANSWER)):
            done = end == len(ANSWER)
            yield RequestOutput("r0", "x", [1], [CompletionOutput(
                0, ANSWER[:end], list(range(end)), finish_reason="stop" if done else None)],
                finished=done)


def test_the_chat_stream_sends_reasoning_then_content():
    ctx = ServerContext(engine=ThinkingEngine(), model_name="m", max_waiting=8,
                        max_body_bytes=1 << 20, reasoning_parser=REASONING_PARSERS["qwen3"]())
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "2+2?"}],
                                stream=True)
    deltas = [c["choices"][0]["delta"] for c in
              _collect(ctx, serving_chat._stream(ctx, req, "chatcmpl-1", [Stream()], hold=0))]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nadd them"
    assert "".join(d.get("content", "") for d in deltas) == "\n\nIt is 4."
    assert not any("think>" in d.get("content", "") + d.get("reasoning_content", "")
                   for d in deltas)
    first_content = next(i for i, d in enumerate(deltas[1:], 1) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content + 1:])


def test_an_output_constraint_beside_a_reasoning_parser_binds_the_answer(tmp_path, llama_dir):
    """qwen3: the answer thinks only if its first token opens <think>; this tokenizer has
    no such token, so the whole answer is bound and parses."""
    import json

    import httpx
    from tests.entrypoints.conftest import ServerProcess
    server = ServerProcess(llama_dir, tmp_path / "log", "--reasoning-parser", "qwen3")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    try:
        server.wait_healthy()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "n", "schema": schema}}}
        for stream in (False, True):
            r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": stream},
                           timeout=60)
            assert r.status_code == 200, r.text
            if stream:
                deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in
                          r.text.splitlines() if line.startswith("data: {")]
                content = "".join(d.get("content") or "" for d in deltas)
            else:
                message = r.json()["choices"][0]["message"]
                assert "reasoning_content" in message and not message["reasoning_content"]
                content = message["content"]
            assert json.loads(content)["n"] <= 99
    finally:
        server.terminate()


THINK_THEN_CALL = ('<think>\nthe user wants Oslo</think>\n\nLet me look.\n<tool_call>\n'
                   '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


class CallingEngine(StubEngine):
    async def stream_outputs(self, stream):
        ends = list(range(3, len(THINK_THEN_CALL), 4)) + [len(THINK_THEN_CALL)]
        for end in ends:
            done = end == len(THINK_THEN_CALL)
            yield RequestOutput("r0", "x", [1], [CompletionOutput(
                0, THINK_THEN_CALL[:end], list(range(end)),
                finish_reason="stop" if done else None)], finished=done)


def test_reasoning_and_tool_calls_stream_as_deltas_that_add_up_to_the_whole_answer():
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
    from kvserve.entrypoints.openai.tools import extract_calls, plan_tools
    from tests.entrypoints.test_tools_server import TOOLS

    ctx = ServerContext(engine=CallingEngine(), model_name="m", max_waiting=8,
                        max_body_bytes=1 << 20, tool_parser=TOOL_PARSERS["hermes"](),
                        reasoning_parser=REASONING_PARSERS["qwen3"]())
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Oslo?"}],
                                tools=TOOLS, stream=True)

    class Shows:  # a template that shows the tools
        def renders_tools(self, template=None):
            return True

    plan = plan_tools(req, Shows())
    state = ChatCompletionStreamState()
    chunks = _collect(ctx, serving_chat._stream(ctx, req, "chatcmpl-1", [Stream()], 0, plan))
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    got = state.get_final_completion().choices[0]
    reasoning, rest = serving_chat.split_reasoning(ctx, THINK_THEN_CALL)
    content, calls = extract_calls(plan, ctx.tool_parser, rest)
    assert reasoning == "\nthe user wants Oslo" and content == "\n\nLet me look."
    assert "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks) \
        == reasoning
    assert got.message.content == content and got.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == \
        [(name, args) for _, name, args in calls]
    pieces = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert len(pieces) > 2  # the arguments streamed as they were written

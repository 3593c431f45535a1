"""Streamed responses send a chunk for every step that produced tokens, as vLLM does,
even when the tokens added no text yet (half of a character, text held back before a
possible stop string); a step with no new token sends nothing."""
from __future__ import annotations

import asyncio
import json

from kvserve.entrypoints.openai import serving_chat, serving_completions
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.entrypoints.openai.context import ServerContext
from kvserve.entrypoints.openai.streaming import SSEResponse
from kvserve.outputs import CompletionOutput, RequestOutput


def _out(text: str, ids: list[int], finish: str | None = None) -> RequestOutput:
    return RequestOutput("r0", "x", [1], [CompletionOutput(0, text, ids, finish_reason=finish)],
                         finished=finish is not None)


# cumulative outputs as the engine posts them: token 6 is half of "é", a repeat
# of an output (nothing new) must not become a chunk
OUTPUTS = [_out("a", [5]), _out("a", [5]), _out("a", [5, 6]), _out("aé", [5, 6, 7]),
           _out("aé!", [5, 6, 7, 8], "length")]


class StubEngine:
    tokenizer = None

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def stream_outputs(self, stream):
        for out in OUTPUTS:
            yield out

    def abort(self, request_ids) -> None:
        self.aborted += request_ids


class Stream:
    request_id = "r0"


def _collect(ctx: ServerContext, gen) -> list[dict]:
    body = SSEResponse(gen, ctx.engine, [Stream()], "test stream").body_iterator

    async def run():
        return [chunk async for chunk in body]
    lines = asyncio.run(run())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def _ctx() -> ServerContext:
    return ServerContext(engine=StubEngine(), model_name="m", max_waiting=8,
                         max_body_bytes=1 << 20)


def test_completion_stream_sends_a_chunk_per_step_with_tokens():
    req = CompletionRequest(model="m", prompt="x", stream=True)
    ctx = _ctx()
    chunks = _collect(ctx, serving_completions._stream(ctx, req, "cmpl-1", [Stream()],
                                                       [("x", [1])], [""], hold=0))
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "", "é", "!"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert ctx.engine.aborted == ["r0"]


def test_chat_stream_sends_a_chunk_per_step_with_tokens():
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                stream=True)
    ctx = _ctx()
    chunks = _collect(ctx, serving_chat._stream(ctx, req, "chatcmpl-1", [Stream()], hold=0))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d.get("content") for d in deltas[1:]] == ["a", "", "é", "!"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert ctx.engine.aborted == ["r0"]


def test_a_failure_mid_stream_ends_in_one_error_event_then_done():
    async def failing():
        yield "data: {\"first\": 1}\n\n"
        raise RuntimeError("boom")

    ctx = _ctx()
    chunks = _collect(ctx, failing())
    assert chunks[0] == {"first": 1}
    assert chunks[1]["error"]["code"] == "internal_error"
    assert len(chunks) == 2
    assert ctx.engine.aborted == ["r0"]

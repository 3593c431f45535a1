"""POST /v1/responses: OpenAI's Responses API over the chat machinery (template, tools,
reasoning, output constraints), whole or as the typed events the official client
parses: ``response.created``, each output item ``added`` with its deltas
(``output_text.delta``, ``function_call_arguments.delta``, ``reasoning_text.delta``) and
``done``, then ``response.completed``."""
from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from kvserve.entrypoints.openai.context import ServerContext, random_id
from kvserve.entrypoints.openai.request_body import parse_request
from kvserve.entrypoints.openai.responses_protocol import ResponsesRequest, as_chat_request
from kvserve.entrypoints.openai.serving_chat import prepare_chat, split_reasoning
from kvserve.entrypoints.openai.streaming import (ChoiceState, SSEResponse, add_all,
                                                  finished_outputs, hold_back, iterate_streams)
from kvserve.entrypoints.openai.tools import ToolCallStream, extract_calls
from kvserve.tracing import trace_headers


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _message(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or _item_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if status == "completed" else []}


def _function_call(call_id: str, name: str, arguments: str, status: str = "completed",
                   item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or _item_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def _reasoning(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or _item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
            "status": status}


class ResponseShape:
    """The response object around the output items, as the request set it up."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest) -> None:
        self.id, self.created = random_id("resp"), int(time.time())
        choice = req.tool_choice
        self.fields = {
            "object": "response", "model": ctx.model_name, "instructions": req.instructions,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump")
            else (choice or "auto"),
            "tools": [{**t.model_dump(exclude_none=True), "parameters": t.parameters or {},
                       "strict": t.strict} for t in req.tools or []],
            "temperature": req.temperature, "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                if req.text and req.text.format else {"type": "text"})},
            "metadata": req.metadata or {}, "store": False, "truncation": "disabled",
            "previous_response_id": None, "error": None}

    def body(self, output: list[dict], status: str, usage: dict | None = None,
             finish_reason: str | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        if incomplete:
            status = "incomplete"
        return {"id": self.id, "created_at": self.created, "status": status, "output": output,
                "incomplete_details": incomplete, "usage": usage, **self.fields}


def _usage(out) -> dict:
    prompt, generated = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated}


async def create_response(request: Request, ctx: ServerContext) -> Response:
    arrival = time.monotonic()
    req = await parse_request(request, ResponsesRequest, ctx.max_body_bytes)
    ctx = ctx.for_model(req.model)
    req.check_supported()
    chat_req = as_chat_request(req)
    chat = await prepare_chat(ctx, chat_req)
    ctx.check_capacity(1)
    shape = ResponseShape(ctx, req)
    streams = await add_all(ctx, shape.id, [{"prompt": chat.text,
                                             "prompt_token_ids": chat.token_ids}],
                            [chat.params], 0, arrival, trace_headers(request.headers),
                            final_only=not req.stream)
    if req.stream:
        events = _events(ctx, shape, streams, hold_back(chat.params), chat.plan)
        return SSEResponse(events, ctx.engine, streams, f"response stream {shape.id}")
    finals = await finished_outputs(request, ctx, streams)
    out = finals[0]
    o = out.outputs[0]
    reasoning, text = split_reasoning(ctx, o.text)
    content, calls = extract_calls(chat.plan, ctx.tool_parser, text)
    items = ([_reasoning(reasoning)] if reasoning else []) \
        + ([_message(content)] if content else []) \
        + [_function_call(cid, name, args) for cid, name, args in calls]
    body = shape.body(items, "completed", _usage(out), o.finish_reason)
    return Response(json.dumps(body), media_type="application/json")


class _EventWriter:
    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


async def _events(ctx: ServerContext, shape: ResponseShape, streams, hold: int, plan
                  ) -> AsyncIterator[str]:
    """Typed events: each output item opened when its first piece comes, its deltas,
    and all closed in order at the end."""
    event = _EventWriter()
    yield event("response.created", response=shape.body([], "in_progress"))
    yield event("response.in_progress", response=shape.body([], "in_progress"))
    state = ChoiceState(hold)
    thinking = ctx.reasoning_parser.stream() if ctx.reasoning_parser is not None else None
    calls = ToolCallStream(plan, ctx.tool_parser) if plan is not None else None
    items: list[dict] = []  # open items, in output order
    texts: dict[int, str] = {}  # output index -> text so far (message, reasoning, call)
    message = reasoning_item = None
    call_items: dict[int, int] = {}  # call index -> output index
    answer, last = "", None
    async for _, out in iterate_streams(ctx.engine, streams):
        last = out
        o = out.outputs[0]
        text, _, _ = state.advance(o)
        reasoning = ""
        if thinking is not None:
            reasoning, text = thinking.feed(text, final=state.done)
        deltas = []
        if calls is not None:
            answer += text
            text, deltas = calls.feed(answer, final=state.done)
        if reasoning:
            if reasoning_item is None:
                reasoning_item = len(items)
                items.append(_reasoning("", "in_progress"))
                texts[reasoning_item] = ""
                yield event("response.output_item.added", output_index=reasoning_item,
                            item=items[reasoning_item])
            texts[reasoning_item] += reasoning
            yield event("response.reasoning_text.delta", item_id=items[reasoning_item]["id"],
                        output_index=reasoning_item, content_index=0, delta=reasoning)
        if text:
            if message is None:
                message = len(items)
                items.append(_message("", "in_progress"))
                texts[message] = ""
                yield event("response.output_item.added", output_index=message,
                            item=items[message])
                yield event("response.content_part.added", item_id=items[message]["id"],
                            output_index=message, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})
            texts[message] += text
            yield event("response.output_text.delta", item_id=items[message]["id"],
                        output_index=message, content_index=0, delta=text, logprobs=[])
        for d in deltas:
            if d.id is not None:
                call_items[d.index] = len(items)
                items.append(_function_call(d.id, d.function.name, "", "in_progress"))
                texts[call_items[d.index]] = ""
                yield event("response.output_item.added", output_index=call_items[d.index],
                            item=items[call_items[d.index]])
            index = call_items[d.index]
            if d.function.arguments:
                texts[index] += d.function.arguments
                yield event("response.function_call_arguments.delta",
                            item_id=items[index]["id"], output_index=index,
                            delta=d.function.arguments)
    done = []
    for index, item in enumerate(items):
        full = texts[index]
        if item["type"] == "message":
            final = _message(full, item_id=item["id"])
            yield event("response.output_text.done", item_id=item["id"], output_index=index,
                        content_index=0, text=full, logprobs=[])
            yield event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=final["content"][0])
        elif item["type"] == "reasoning":
            final = _reasoning(full, item_id=item["id"])
            yield event("response.reasoning_text.done", item_id=item["id"],
                        output_index=index, content_index=0, text=full)
        else:
            final = _function_call(item["call_id"], item["name"], full, item_id=item["id"])
            yield event("response.function_call_arguments.done", item_id=item["id"],
                        output_index=index, name=item["name"], arguments=full)
        yield event("response.output_item.done", output_index=index, item=final)
        done.append(final)
    finish = last.outputs[0].finish_reason if last is not None else None
    body = shape.body(done, "completed", _usage(last) if last is not None else None, finish)
    yield event(f"response.{body['status']}", response=body)

"""POST /v1/chat/completions: messages through the model's chat template."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from kvserve.entrypoints.openai.errors import bad_request
from kvserve.entrypoints.openai.protocol import (ChatChoice, ChatChoiceLogprobs,
                                                 ChatCompletionChunk, ChatCompletionRequest,
                                                 ChatCompletionResponse, ChatMessage,
                                                 ChatResponseMessage, ChatStreamChoice,
                                                 ChatTokenLogprob, ChatTopLogprob,
                                                 DeltaMessage,
                                                 ResponseFunctionCall, ResponseToolCall,
                                                 UsageInfo)
from kvserve.entrypoints.openai.context import ServerContext, random_id
from kvserve.entrypoints.openai.request_body import parse_request
from kvserve.entrypoints.openai.sampling import check_prompt, default_max_tokens, \
    make_sampling_params, \
    truncate_prompt
from kvserve.tracing import trace_headers
from kvserve.batch.lines import is_batch_line
from kvserve.entrypoints.openai.streaming import (ChoiceState, SSEResponse, add_all,
                                                  finished_outputs, hold_back, iterate_streams,
                                                  sse, usage_so_far)
from kvserve.entrypoints.openai.tools import ToolCallStream, ToolPlan, conversation, \
    extract_calls, forced_call, plan_tools
from kvserve.sampling_params import SamplingParams
from kvserve.model.token_text import TokenTexts

_LONG_TEXT = 4096


async def render_chat(ctx: ServerContext, messages: list[ChatMessage],
                      add_generation_prompt: bool, tools: list[dict] | None = None,
                      req: ChatCompletionRequest | None = None) -> tuple[str, list[int]]:
    """Chat template -> (text, token ids), as LLM.chat does; ``req``: the chat request's
    template fields (documents, continue_final_message, chat_template_kwargs)."""
    tok = ctx.engine.tokenizer
    fields = {} if req is None else dict(
        documents=req.documents, continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs)
    fields["chat_template"] = ctx.chat_template
    try:
        text = tok.apply_chat_template(conversation(messages), add_generation_prompt,
                                       [{"type": "function", "function": f} for f in tools]
                                       if tools else None, **fields)
    except ValueError as e:
        param = ("chat_template_kwargs" if "chat_template_kwargs" in str(e) else
                 "continue_final_message" if "continue_final_message" in str(e) else
                 "messages")
        raise bad_request(str(e), param) from None
    if len(text) > _LONG_TEXT:
        ids = await asyncio.to_thread(tok.encode, text, False)
    else:
        ids = tok.encode(text, add_special_tokens=False)
    return text, ids


def chat_logprobs(token_ids: list[int], entries: list[dict], texts: TokenTexts,
                  top_n: int) -> list[ChatTokenLogprob]:
    content = []
    for tid, entry in zip(token_ids, entries):
        token = texts(tid)
        chosen = entry.get(tid)
        tops = [ChatTopLogprob(token=texts(k), logprob=v.logprob, bytes=texts.bytes(k))
                for k, v in sorted(entry.items(), key=lambda kv: kv[1].rank)][:top_n]
        content.append(ChatTokenLogprob(
            token=token, logprob=chosen.logprob if chosen is not None else float("-inf"),
            bytes=texts.bytes(tid), top_logprobs=tops))
    return content


@dataclasses.dataclass
class ChatPrompt:
    """A chat request made ready for the engine: its tools, prompt and parameters."""

    plan: ToolPlan | None
    text: str
    token_ids: list[int]
    params: SamplingParams


async def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest) -> ChatPrompt:
    """The rendered prompt and the sampling parameters of a chat request (the Responses
    API's too), with its tools and output constraints settled; 400s name the field."""
    plan = plan_tools(req, ctx.engine.tokenizer, ctx.chat_template, ctx.auto_tool_choice)
    forced = forced_call(plan, ctx.tool_parser)
    if forced is not None and req.response_format is not None:
        raise bad_request("a forced tool call and response_format cannot be combined",
                          "response_format")
    text, ids = await render_chat(ctx, req.messages, req.add_generation_prompt,
                                  plan.functions if plan else None, req)
    if req.truncate_prompt_tokens is not None:
        ids = truncate_prompt(ids, req.truncate_prompt_tokens, ctx.engine.max_model_len)
        text = ctx.engine.tokenizer.decode(ids)
    defaults = ctx.engine.sampling_defaults
    max_tokens = default_max_tokens(req.max_completion_tokens or req.max_tokens, defaults,
                                    ctx.engine.max_model_len - len(ids))  # None: the room
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = make_sampling_params(req, max_tokens, logprobs, ctx.engine.tokenizer, defaults)
    if plan is not None and ctx.tool_parser.needs_special_tokens:
        params.skip_special_tokens = False  # the call's marker is a special token
    if forced is not None:
        if params.structured_outputs is not None:
            raise bad_request("a forced tool call and another output constraint cannot be "
                              "combined", "tool_choice")
        params.structured_outputs = forced
    if ctx.reasoning_parser is not None and params.structured_outputs is not None:
        params.structured_outputs = dataclasses.replace(  # it binds the answer, not the thinking
            params.structured_outputs, reasoning=ctx.reasoning_parser.span())
    check_prompt(ctx, ids, params)
    return ChatPrompt(plan, text, ids, params)


async def create_chat_completion(request: Request, ctx: ServerContext) -> Response:
    arrival = time.monotonic()
    req = await parse_request(request, ChatCompletionRequest, ctx.max_body_bytes)
    ctx = ctx.for_model(req.model)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    chat = await prepare_chat(ctx, req)
    plan, text, ids, params = chat.plan, chat.text, chat.token_ids, chat.params
    ctx.check_capacity(req.n)
    request_id = random_id("chatcmpl")
    streams = await add_all(ctx, request_id, [{"prompt": text, "prompt_token_ids": ids}],
                            [params], req.priority, arrival,
                            trace_headers(request.headers), is_batch_line(request),
                            final_only=not req.stream)
    if req.stream:
        gen = _stream(ctx, req, request_id, streams, hold_back(params), plan)
        return SSEResponse(gen, ctx.engine, streams, f"chat stream {request_id}")
    finals = await finished_outputs(request, ctx, streams)
    out = finals[0]
    texts = TokenTexts(ctx.engine.tokenizer)
    choices = []
    usage = UsageInfo(prompt_tokens=len(out.prompt_token_ids))
    for o in out.outputs:
        usage.completion_tokens += len(o.token_ids)
        lp = None
        if req.logprobs:
            lp = ChatChoiceLogprobs(content=chat_logprobs(o.token_ids, o.logprobs or [], texts,
                                                          req.top_logprobs or 0))
        reasoning, text = split_reasoning(ctx, o.text)
        content, calls = extract_calls(plan, ctx.tool_parser, text)
        message = ChatResponseMessage(content=content or (None if reasoning else content),
                                      reasoning_content=reasoning, tool_calls=[
            ResponseToolCall(id=cid, function=ResponseFunctionCall(name=name, arguments=args))
            for cid, name, args in calls])
        reason = "tool_calls" if calls and o.finish_reason == "stop" else o.finish_reason
        choices.append(ChatChoice(index=o.index, message=message, logprobs=lp,
                                  finish_reason=reason, stop_reason=o.stop_reason))
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    body = ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                                  usage=usage)
    return Response(body.model_dump_json(), media_type="application/json")


async def _stream(ctx: ServerContext, req: ChatCompletionRequest, request_id: str, streams,
                  hold: int, plan=None) -> AsyncIterator[str]:
    """Server-sent chunks: each choice's reasoning, content and tool calls as deltas."""
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    exclude = None if include_usage else {"usage"}
    texts = TokenTexts(ctx.engine.tokenizer)

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name,
                                       choices=choices, usage=usage),
                   None if usage is not None else exclude)

    states = {j: ChoiceState(hold) for j in range(req.n)}
    thinking = {j: ctx.reasoning_parser.stream() for j in range(req.n)} \
        if ctx.reasoning_parser is not None else None
    calls = {j: ToolCallStream(plan, ctx.tool_parser) for j in range(req.n)} \
        if plan is not None else None
    answers = dict.fromkeys(range(req.n), "")  # each choice's answer after its reasoning
    usage = UsageInfo()
    for j in range(req.n):  # OpenAI opens each choice with the role
        yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant",
                                                                  content=""))])
    async for _, out in iterate_streams(ctx.engine, streams):
        for o in out.outputs:
            state = states[o.index]
            if state.done:
                continue
            text, ids, lps = state.advance(o)
            if state.nothing_to_send(text, ids):
                continue
            logprobs = None
            if req.logprobs:
                logprobs = ChatChoiceLogprobs(content=chat_logprobs(
                    ids, lps or [], texts, req.top_logprobs or 0))
            reasoning = tool_calls = None
            if thinking is not None:
                reasoning, text = thinking[o.index].feed(text, final=state.done)
            if calls is not None:
                answers[o.index] += text
                text, tool_calls = calls[o.index].feed(answers[o.index], final=state.done)
            if thinking is None and calls is None:
                delta = DeltaMessage(content=text) if text or not state.done else DeltaMessage()
            elif reasoning or text or tool_calls or state.done or logprobs:
                delta = DeltaMessage(content=text or None, reasoning_content=reasoning or None,
                                     tool_calls=tool_calls or None)
            else:
                continue  # all held back: maybe a tag's or a call's first characters
            reason = o.finish_reason if state.done else None
            if reason == "stop" and calls is not None and calls[o.index].num_calls:
                reason = "tool_calls"
            yield chunk([ChatStreamChoice(
                index=o.index, delta=delta, logprobs=logprobs, finish_reason=reason,
                stop_reason=o.stop_reason if state.done else None)],
                usage_so_far(out) if continuous else None)
        if out.finished:
            usage.prompt_tokens = len(out.prompt_token_ids)
            usage.completion_tokens = sum(len(o.token_ids) for o in out.outputs)
    if include_usage:
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        yield chunk([], usage)


def split_reasoning(ctx: ServerContext, text: str) -> tuple[str | None, str]:
    """(reasoning, the rest) of a whole answer; (None, text) without a reasoning parser."""
    if ctx.reasoning_parser is None:
        return None, text
    reasoning, content = ctx.reasoning_parser.split(text)
    return reasoning, content or ""

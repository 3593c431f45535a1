"""POST /v1/completions: prompt(s) in, choices (prompt i, sample j -> index i*n+j) out."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from kvserve.entrypoints.openai.errors import bad_request
from kvserve.entrypoints.openai.protocol import (MAX_PROMPTS, CompletionChoice,
                                                 CompletionLogprobs, CompletionRequest,
                                                 CompletionResponse, PromptLogprob, UsageInfo)
from kvserve.entrypoints.openai.context import ServerContext, random_id
from kvserve.entrypoints.openai.request_body import parse_request
from kvserve.entrypoints.openai.serving_beam_search import beam_params, beam_search_completion
from kvserve.entrypoints.openai.sampling import check_prompt, default_max_tokens, \
    make_sampling_params, \
    truncate_prompt
from kvserve.tracing import trace_headers
from kvserve.batch.lines import is_batch_line
from kvserve.sampling_params import SamplingParams
from kvserve.entrypoints.openai.streaming import (ChoiceState, SSEResponse, add_all,
                                                  finished_outputs, hold_back, iterate_streams,
                                                  sse, usage_so_far)
from kvserve.model.token_text import TokenTexts

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
_LONG_TEXT = 4096  # prompts longer than this are tokenized off the event loop


async def tokenize_prompts(ctx: ServerContext, prompt, param: str = "prompt"
                           ) -> list[tuple[str | None, list[int]]]:
    """A request's prompt(s) -> (text or None, token ids) each; ``param``: the field's
    name in errors."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request(f"{param} must not be empty", param)
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}",
                          param)
    encode = ctx.engine.tokenizer.encode
    out = []
    for p in prompt:
        if not p:
            raise bad_request(f"{param} must not be empty", param)
        if isinstance(p, str):
            ids = await asyncio.to_thread(encode, p) if len(p) > _LONG_TEXT else encode(p)
            out.append((p, ids))
        else:
            out.append((None, list(p)))
    return out


def completion_logprobs(token_ids: list[int], entries: list[dict], texts: TokenTexts,
                        offset: int, prompt_ids: list[int] | None = None,
                        prompt_entries: list[dict | None] | None = None
                        ) -> tuple[CompletionLogprobs, int]:
    """OpenAI's {tokens, token_logprobs, top_logprobs, text_offset}, echoed prompt tokens
    first (the first prompt token has no logprob: null). Returns the offset after the
    last token (for streaming)."""
    lp = CompletionLogprobs()
    prompt_ids = prompt_ids or []
    tokens = list(zip(prompt_ids, prompt_entries or [None] * len(prompt_ids)))
    tokens += list(zip(token_ids, entries))
    for tid, entry in tokens:
        text = texts(tid)
        chosen = entry.get(tid) if entry is not None else None
        lp.tokens.append(text)
        lp.token_logprobs.append(chosen.logprob if chosen is not None else None)
        lp.top_logprobs.append(None if entry is None else {
            texts(k): v.logprob for k, v in sorted(entry.items(), key=lambda kv: kv[1].rank)})
        lp.text_offset.append(offset)
        offset += len(text)
    return lp, offset


def _vllm_prompt_logprobs(entries, texts: TokenTexts):
    return [None if e is None else {str(t): PromptLogprob(logprob=v.logprob, rank=v.rank,
                                                          decoded_token=texts(t))
                                    for t, v in e.items()} for e in entries]


async def create_completion(request: Request, ctx: ServerContext) -> Response:
    arrival = time.monotonic()
    req = await parse_request(request, CompletionRequest, ctx.max_body_bytes)
    ctx = ctx.for_model(req.model)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n and not req.use_beam_search:
        raise bad_request("best_of must equal n (or be omitted) without use_beam_search",
                          "best_of")
    for name, unset in (("length_penalty", 1.0), ("early_stopping", False)):
        if getattr(req, name) != unset and not req.use_beam_search:
            raise bad_request(f"{name} applies to beam search only: set use_beam_search",
                              name)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if req.max_tokens == 0 and (not req.echo or req.stream):
        raise bad_request("max_tokens 0 scores the prompt: it needs echo=true and no "
                          "stream", "max_tokens")
    prompts = await tokenize_prompts(ctx, req.prompt)
    if req.truncate_prompt_tokens is not None:
        tok, limit, vocab = ctx.engine.tokenizer, ctx.engine.max_model_len, ctx.engine.vocab_size
        cuts = [truncate_prompt(ids, req.truncate_prompt_tokens, limit) for _, ids in prompts]
        # ids outside the vocabulary are not decoded: the prompt check refuses them below
        prompts = [(tok.decode(cut) if all(0 <= t < vocab for t in cut) else None, cut)
                   for cut in cuts]
    if req.use_beam_search:
        limit = ctx.engine.max_model_len - max(len(ids) for _, ids in prompts)
        beams = beam_params(req, min(req.max_tokens or _DEFAULT_MAX_TOKENS, max(1, limit)))
        for _, ids in prompts:
            check_prompt(ctx, ids, SamplingParams(max_tokens=beams.max_tokens))
        return await beam_search_completion(request, ctx, req, [ids for _, ids in prompts],
                                            beams)
    want_prompt = req.prompt_logprobs is not None or (req.echo and req.logprobs is not None)
    num_top = max(req.prompt_logprobs or 0, req.logprobs or 0) if want_prompt else None
    params = []
    for _, ids in prompts:
        room = ctx.engine.max_model_len - len(ids)
        defaults = ctx.engine.sampling_defaults
        max_tokens = 1 if req.max_tokens == 0 else (
            default_max_tokens(req.max_tokens, defaults, room)
            or max(1, min(_DEFAULT_MAX_TOKENS, room)))
        sp = make_sampling_params(req, max_tokens, req.logprobs, ctx.engine.tokenizer, defaults)
        sp.prompt_logprobs = num_top
        check_prompt(ctx, ids, sp)
        params.append(sp)
    tok = ctx.engine.tokenizer
    texts = [t if t is not None else tok.decode(ids) for t, ids in prompts] if req.echo else []
    ctx.check_capacity(len(prompts) * req.n)
    request_id = random_id("cmpl")
    streams = await add_all(ctx, request_id, [{"prompt": t, "prompt_token_ids": ids}
                                              for t, ids in prompts], params,
                            req.priority, arrival,
                            trace_headers(request.headers), is_batch_line(request),
                            final_only=not req.stream)
    if req.stream:
        gen = _stream(ctx, req, request_id, streams, prompts, texts, hold_back(params[0]))
        return SSEResponse(gen, ctx.engine, streams, f"completion stream {request_id}")
    finals = await finished_outputs(request, ctx, streams)
    return _response(ctx, req, request_id, finals, prompts, texts)


def _response(ctx, req, request_id, finals, prompts, echo_texts) -> Response:
    token_texts = TokenTexts(ctx.engine.tokenizer)
    choices, usage = [], UsageInfo()
    for i, out in enumerate(finals):
        usage.prompt_tokens += len(out.prompt_token_ids)
        prefix = echo_texts[i] if req.echo else ""
        score_only = req.max_tokens == 0  # the one token generated is not part of it
        for o in out.outputs:
            ids, entries = ([], []) if score_only else (o.token_ids, o.logprobs or [])
            usage.completion_tokens += len(ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs, _ = completion_logprobs(
                    ids, entries, token_texts, 0, prompts[i][1] if req.echo else None,
                    out.prompt_logprobs if req.echo else None)
            choices.append(CompletionChoice(
                index=i * req.n + o.index, text=prefix + ("" if score_only else o.text),
                logprobs=logprobs, finish_reason="length" if score_only else o.finish_reason,
                stop_reason=None if score_only else o.stop_reason,
                prompt_logprobs=(_vllm_prompt_logprobs(out.prompt_logprobs, token_texts)
                                 if req.prompt_logprobs is not None else None)))
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    choices.sort(key=lambda c: c.index)
    body = CompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=usage)
    return Response(body.model_dump_json(), media_type="application/json")


async def _stream(ctx: ServerContext, req: CompletionRequest, request_id: str, streams,
                  prompts, echo_texts, hold: int) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    exclude = None if include_usage else {"usage"}
    token_texts = TokenTexts(ctx.engine.tokenizer)
    states: dict[int, ChoiceState] = {}
    offsets: dict[int, int] = {}
    usage = UsageInfo()
    async for i, out in iterate_streams(ctx.engine, streams):
        for o in out.outputs:
            index = i * req.n + o.index
            state = states.get(index)
            first = state is None
            if first:
                state = states[index] = ChoiceState(hold)
            elif state.done:
                continue
            text, ids, lps = state.advance(o)
            if first and req.echo:
                text = echo_texts[i] + text
            if state.nothing_to_send(text, ids):
                continue
            logprobs = None
            if req.logprobs is not None:
                logprobs, offsets[index] = completion_logprobs(
                    ids, lps or [], token_texts, offsets.get(index, 0),
                    prompts[i][1] if first and req.echo else None,
                    out.prompt_logprobs if first and req.echo else None)
            choice = CompletionChoice(
                index=index, text=text, logprobs=logprobs,
                finish_reason=o.finish_reason if state.done else None,
                stop_reason=o.stop_reason if state.done else None,
                prompt_logprobs=(_vllm_prompt_logprobs(out.prompt_logprobs, token_texts)
                                 if first and req.prompt_logprobs is not None else None))
            running = usage_so_far(out) if continuous else None
            yield sse(CompletionStreamChunk(id=request_id, created=created,
                                            model=ctx.model_name, choices=[choice],
                                            usage=running),
                      None if running is not None else exclude)
        if out.finished:
            usage.prompt_tokens += len(out.prompt_token_ids)
            usage.completion_tokens += sum(len(o.token_ids) for o in out.outputs)
    if include_usage:
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        yield sse(CompletionStreamChunk(id=request_id, created=created,
                                        model=ctx.model_name, choices=[], usage=usage))


CompletionStreamChunk = CompletionResponse  # same shape; usage stays null until the end

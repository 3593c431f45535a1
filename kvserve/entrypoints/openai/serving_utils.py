"""Pieces shared by the completion and chat handlers: reading the body, sampling
parameters, token text for logprobs, stream deltas, SSE and client disconnects."""
from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from kvserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from kvserve.entrypoints.openai.errors import (APIError, bad_request, from_validation_error,
                                               from_value_error)
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

SAMPLING_FIELDS = frozenset(
    {"n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
     "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens",
     "min_tokens", "logprobs", "prompt", "messages"})


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ServerContext:
    """What every handler needs: the engine and the server's settings."""

    engine: AsyncLLMEngine
    model_name: str
    max_waiting: int
    max_body_bytes: int

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist. This server serves "
                           f"`{self.model_name}` (see GET /v1/models).", 404, param="model",
                           code="model_not_found")

    def check_capacity(self, num_new: int) -> None:
        if not self.engine.is_running:
            raise APIError("the server is shutting down or its engine stopped", 503)
        waiting = self.engine.num_waiting
        if waiting + num_new > self.max_waiting:
            raise APIError(f"the server is busy: {waiting} requests are waiting (limit "
                           f"{self.max_waiting}); retry later", 429,
                           code="rate_limit_exceeded")


async def read_body(request: Request, max_bytes: int) -> bytes:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(f"Content-Type must be application/json, got {ctype!r}", 415)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(f"request body of {int(length)} bytes exceeds the limit of "
                       f"{max_bytes} bytes", 413, code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(f"request body exceeds the limit of {max_bytes} bytes", 413,
                               code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError("client disconnected while sending the body", 400) from None
    return b"".join(chunks)


async def parse_request(request: Request, model_cls: type[M], max_bytes: int) -> M:
    body = await read_body(request, max_bytes)
    if not body.strip():
        raise bad_request("request body is empty: send a JSON object")
    try:
        return model_cls.model_validate_json(body, strict=True)
    except ValidationError as e:
        raise from_validation_error(e) from None


def make_sampling_params(req: Any, max_tokens: int | None, logprobs: int | None
                         ) -> SamplingParams:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    kwargs = dict(n=req.n, stop=req.stop, seed=req.seed, stop_token_ids=req.stop_token_ids,
                  ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
                  logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
                  include_stop_str_in_output=req.include_stop_str_in_output)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e, SAMPLING_FIELDS) from None


def check_prompt(ctx: ServerContext, token_ids: list[int], params: SamplingParams) -> None:
    """The engine's own prompt checks, run before anything is queued."""
    try:
        ctx.engine.engine.validate_prompt(token_ids, params)
    except ValueError as e:
        raise from_value_error(e, SAMPLING_FIELDS) from None


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character standing for each byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_LEVEL = _byte_level_decoder()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """Token id -> its text (and raw bytes) for logprobs, cached: the vocabulary is finite."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 1_000_000:
                self._cache[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes, also for a token that is part of a UTF-8 character."""
        text = self(token_id)
        if "\ufffd" in text:
            piece = self._tok.id_to_token(token_id) or ""
            m = _BYTE_PIECE.fullmatch(piece)
            if m:  # sentencepiece byte fallback
                return [int(m.group(1), 16)]
            if piece and all(c in _BYTE_LEVEL for c in piece):  # byte-level BPE
                return [_BYTE_LEVEL[c] for c in piece]
        return list(text.encode("utf-8"))


class ChoiceState:
    """What one choice has sent so far; yields the next delta.

    While unfinished, the last ``hold`` characters are held back (max stop string length
    minus one) so that a stop string is never streamed partially.
    """

    __slots__ = ("hold", "text_len", "num_tokens", "done")

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.text_len = 0
        self.num_tokens = 0
        self.done = False

    def advance(self, out: CompletionOutput) -> tuple[str, list[int], list | None]:
        finished = out.finish_reason is not None
        end = len(out.text) if finished else len(out.text) - self.hold
        text = out.text[self.text_len:end] if end > self.text_len else ""
        self.text_len = max(self.text_len, end)
        n = len(out.token_ids)
        ids = out.token_ids[self.num_tokens:n]
        lps = out.logprobs[self.num_tokens:n] if out.logprobs is not None else None
        self.num_tokens = n
        self.done = finished
        return text, ids, lps

    def nothing_to_send(self, text: str, ids: list[int]) -> bool:
        """A chunk goes out for every delta with new tokens, as vLLM's: their text may be
        held back (half a character, a possible stop string) and still be empty."""
        return not text and not ids and not self.done


def hold_back(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop_list), default=1) - 1


def sse(payload: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that aborts its requests however the response ends,
    even when the client leaves before the first chunk (the body never starts)."""

    def __init__(self, content: AsyncIterator[str], engine: AsyncLLMEngine,
                 streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._engine = engine
        self._ids = [s.request_id for s in streams]

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine.abort(self._ids)
            await self.body_iterator.aclose()


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; if the client goes away first, cancel it (its finally aborts)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    raise APIError("client disconnected", 499, code="client_closed_request")


async def add_all(ctx: ServerContext, base_id: str, prompts: list[dict],
                  params: list[SamplingParams], priority: int, arrival: float
                  ) -> list[RequestStream]:
    """Queue one engine request per prompt (ids ``base-i``); all or nothing."""
    streams: list[RequestStream] = []
    try:
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            streams.append(await ctx.engine.add_request(
                f"{base_id}-{i}", prompt, sp, priority=priority, arrival_time=arrival))
    except BaseException as e:
        ctx.engine.abort([s.request_id for s in streams])
        if isinstance(e, ValueError):
            raise from_value_error(e, SAMPLING_FIELDS) from None
        if isinstance(e, EngineDeadError):
            raise APIError(str(e), 503) from None
        raise
    return streams


async def iterate_streams(engine: AsyncLLMEngine, streams: list[RequestStream]
                          ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) from several streams as they progress.

    Leaving early (client gone, error) aborts every unfinished request.
    """
    if len(streams) == 1:
        async for out in engine.stream_outputs(streams[0]):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(streams))

    async def drain(i: int, stream: RequestStream) -> None:
        try:
            async for out in engine.stream_outputs(stream):
                await queue.put((i, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))
        else:
            await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        engine.abort([s.request_id for s in streams])


async def final_outputs(engine: AsyncLLMEngine, streams: list[RequestStream]
                        ) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in iterate_streams(engine, streams):
        if out.finished:
            finals[i] = out
    return finals  # type: ignore[return-value]

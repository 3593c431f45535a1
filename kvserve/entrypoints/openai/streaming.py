"""Streaming a request's outputs: queueing its prompts, per-choice deltas (stop strings
never sent partially), server-sent events ending in one error event when something
fails mid-stream, and aborting whatever the client left."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from pydantic import BaseModel
from starlette.responses import StreamingResponse

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.streams import EngineDeadError, EngineRequestError, RequestStream
from kvserve.entrypoints.openai.context import ServerContext
from kvserve.entrypoints.openai.disconnect import unless_disconnected
from kvserve.entrypoints.openai.errors import (APIError, engine_error, from_value_error,
                                               internal_error)
from kvserve.entrypoints.openai.protocol import UsageInfo
from kvserve.entrypoints.openai.sampling import SAMPLING_FIELDS
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.logger import init_logger
from kvserve.sampling_params import SamplingParams

logger = init_logger(__name__)


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


def usage_so_far(out: RequestOutput):
    """Usage of one request's output up to now (stream_options.continuous_usage_stats)."""
    completion = sum(len(o.token_ids) for o in out.outputs)
    return UsageInfo(prompt_tokens=len(out.prompt_token_ids), completion_tokens=completion,
                     total_tokens=len(out.prompt_token_ids) + completion)


def hold_back(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop_list), default=1) - 1


def sse(payload: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A server-sent-event stream of ``chunks`` that ends with ``[DONE]``; an error
    mid-stream becomes one error event before it (the engine's, the API's, or an internal
    one, logged as ``what``). It aborts its requests however the response ends, even
    when the client leaves before the first chunk (the body never starts)."""

    def __init__(self, chunks: AsyncIterator[str], engine: AsyncLLMEngine,
                 streams: list[RequestStream], what: str) -> None:
        self._engine = engine
        self._ids = [s.request_id for s in streams]
        super().__init__(self._events(chunks, what), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, chunks: AsyncIterator[str], what: str) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except EngineRequestError as e:
            yield engine_error(e).sse()
        except APIError as e:
            yield e.sse()
        except Exception:  # noqa: BLE001 - fail this stream only
            logger.exception("%s failed", what)
            yield internal_error().sse()
        finally:
            self._engine.abort(self._ids)
            await chunks.aclose()
        yield SSE_DONE

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine.abort(self._ids)
            await self.body_iterator.aclose()


async def add_all(ctx: ServerContext, base_id: str, prompts: list[dict],
                  params: list[SamplingParams], priority: int, arrival: float,
                  trace_headers: dict | None = None, background: bool = False,
                  final_only: bool = False) -> list[RequestStream]:
    """Queue one engine request per prompt (ids ``base-i``); all or nothing.
    ``final_only``: a response that is not streamed reads only the finished outputs."""
    streams: list[RequestStream] = []
    try:
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            streams.append(await ctx.engine.add_request(
                f"{base_id}-{i}", prompt, sp, priority=priority, arrival_time=arrival,
                trace_headers=trace_headers, background=background, final_only=final_only,
                lora_request=ctx.lora))
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


async def finished_outputs(request, ctx: ServerContext, streams: list[RequestStream]
                           ) -> list[RequestOutput]:
    """A response that is not streamed: each request's finished output, unless the client
    leaves first; an engine failure is the API's error; the requests never outlive it."""
    try:
        return await unless_disconnected(request, final_outputs(ctx.engine, streams))
    except EngineRequestError as e:
        raise engine_error(e) from None
    finally:
        ctx.engine.abort([s.request_id for s in streams])


async def final_outputs(engine: AsyncLLMEngine, streams: list[RequestStream]
                        ) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in iterate_streams(engine, streams):
        if out.finished:
            finals[i] = out
    return finals  # type: ignore[return-value]

"""One engine replica: the single server's whole app, run inside a Ray Serve replica.

The ingress hands each HTTP request over as a plain dict (method, path, query, headers,
body) with :meth:`EngineReplica.submit`; the replica runs it through the same FastAPI
app ``kvserve serve`` runs, in-process, so routes, errors, validation and streaming are
the single server's, byte for byte.

What the app sends comes back over one long-lived stream per ingress,
:meth:`EngineReplica.channel`, not one stream per request: an engine step produces a
chunk for every running request at once, and carrying them as one Ray item keeps Ray's
per-item cost per step instead of per token. Each item is a list of
``(request_id, start, body, more, error)``: ``start`` the response's
``(status, headers)`` on its first chunk only, ``body`` the bytes the app sent,
``more`` False on the last, ``error`` a message when the app failed the request.

A request ends early when the ingress calls :meth:`cancel` (its client went away) or
its channel closes (the ingress went away): the app then sees ``http.disconnect``,
which aborts the request in the engine.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.logger import init_logger

logger = init_logger(__name__)

Chunk = tuple[str, Any, bytes, bool, "str | None"]
GATHER_ROUNDS = 8  # loop turns a channel waits for more of a step's chunks


class _Channel:
    def __init__(self) -> None:
        self.items: list[Chunk] = []
        self.wake = asyncio.Event()
        self.gone: dict[str, asyncio.Event] = {}  # request id -> set to abort it

    def put(self, item: Chunk) -> None:
        self.items.append(item)
        self.wake.set()


class EngineReplica:
    """The Ray Serve deployment's class (wrapped by ``serve.deployment`` at launch)."""

    async def __init__(self, replica: int, engine_args: Any, observability: Any,
                       app_settings: dict) -> None:
        """Serve awaits this: the engine loads, then starts on this (the user code's)
        loop, so a restarted replica 0 resumes its batches before any request."""
        self.replica = replica
        self._channels: dict[str, _Channel] = {}
        self.engine = await asyncio.to_thread(AsyncLLMEngine.from_engine_args, engine_args,
                                              observability)
        self.app = build_app(self.engine, **app_settings)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        logger.info("replica %d is up", replica)

    def __del__(self):
        """Serve calls this when it stops the replica, and awaits what it returns: the
        engine and the batch store closing (requests still running were drained or are
        aborted). Once that is done, garbage collection finds nothing left to close."""
        lifespan, self._lifespan = getattr(self, "_lifespan", None), None
        return None if lifespan is None else lifespan.__aexit__(None, None, None)

    async def check_health(self) -> None:
        """Ray Serve calls this; raising makes Serve replace the replica."""
        if not self.engine.is_running:
            raise RuntimeError(self.engine.dead_error or "the engine stopped")

    async def channel(self, channel_id: str) -> AsyncIterator[list[Chunk]]:
        """The chunks of every request submitted on ``channel_id``, batched."""
        ch = self._channels[channel_id] = _Channel()
        try:
            yield []  # the ingress submits only once it has this: the channel is open here
            while True:
                await ch.wake.wait()
                for _ in range(GATHER_ROUNDS):  # let the rest of the step's chunks arrive
                    seen = len(ch.items)
                    await asyncio.sleep(0)
                    if len(ch.items) == seen:
                        break
                ch.wake.clear()
                items, ch.items = ch.items, []
                yield items
        finally:
            for gone in ch.gone.values():  # the ingress went away: abort its requests
                gone.set()
            self._channels.pop(channel_id, None)

    async def submit(self, channel_id: str, request_id: str, request: dict) -> None:
        """Start serving ``request``; its chunks go out on ``channel_id``."""
        ch = self._channels.get(channel_id)
        if ch is None:  # the channel is another process's (this replica replaced it)
            raise LookupError(f"replica {self.replica} has no channel {channel_id}")
        gone = ch.gone[request_id] = asyncio.Event()
        asyncio.ensure_future(self._serve(ch, request_id, request, gone))

    async def cancel(self, channel_id: str, request_id: str) -> None:
        ch = self._channels.get(channel_id)
        if ch is not None and request_id in ch.gone:
            ch.gone[request_id].set()

    async def _serve(self, ch: _Channel, rid: str, request: dict, gone: asyncio.Event) -> None:
        body_sent = finished = False
        head = None  # the response's (status, headers) until its first chunk carries it

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request["body"], "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal head, finished
            if message["type"] == "http.response.start":
                head = (message["status"], message.get("headers", []))
            elif message["type"] == "http.response.body" and not finished:
                more = message.get("more_body", False)
                finished = not more
                ch.put((rid, head, message.get("body", b""), more, None))
                head = None

        try:
            await self.app(_scope(request), receive, send)
            if not finished and not gone.is_set():
                raise RuntimeError("the app ended without finishing its response")
        except Exception as e:  # noqa: BLE001 - one failed request, not a dead replica
            logger.exception("replica %d failed request %s", self.replica, rid)
            ch.put((rid, None, b"", False, f"{type(e).__name__}: {e}"))
        finally:
            ch.gone.pop(rid, None)


def _scope(request: dict) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": request["method"], "scheme": "http", "path": request["path"],
            "raw_path": request["path"].encode(), "root_path": "",
            "query_string": request["query_string"], "headers": request["headers"],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}

"""One engine replica: the single server's whole app, run inside a Ray Serve replica.

The ingress hands each HTTP request over as a plain dict (method, path, query, headers,
body); :meth:`EngineReplica.handle` runs it through the same FastAPI app ``kvserve
serve`` runs, in-process, and streams back what the app sends. The routes, errors,
validation and streaming are therefore the single server's, byte for byte.

Each item streamed back is ``(start, body, more)``: ``start`` the response's
``(status, headers)`` on the first item only, then the body bytes the app sent since
the last item, coalesced so that a slow reader costs fewer items. Cancelling the call
(the client went away) makes the app see ``http.disconnect``, which aborts the request.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from kvserve.logger import init_logger

logger = init_logger(__name__)

Item = tuple[Any, bytes, bool]


class EngineReplica:
    """The Ray Serve deployment's class (wrapped by ``serve.deployment`` at launch)."""

    def __init__(self, replica: int, engine_args: Any, observability: Any,
                 app_settings: dict) -> None:
        from kvserve.engine.async_engine import AsyncLLMEngine
        from kvserve.entrypoints.openai.api_server import build_app

        self.replica = replica
        self.engine = AsyncLLMEngine.from_engine_args(engine_args, observability)
        self.app = build_app(self.engine, **app_settings)
        self._lifespan = None
        logger.info("replica %d is up", replica)

    async def _started(self) -> None:
        if self._lifespan is None:  # the engine binds to the loop that reads its streams
            self._lifespan = self.app.router.lifespan_context(self.app)
            await self._lifespan.__aenter__()

    async def check_health(self) -> None:
        """Ray Serve calls this; raising makes Serve replace the replica."""
        if self._lifespan is not None and not self.engine.is_running:
            raise RuntimeError(self.engine.dead_error or "the engine stopped")

    async def handle(self, request: dict) -> AsyncIterator[Item]:
        await self._started()
        pending: list[bytes] = []
        state: dict[str, Any] = {"start": None, "more": True}
        wake = asyncio.Event()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request["body"], "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["start"] = (message["status"], message.get("headers", []))
            elif message["type"] == "http.response.body":
                pending.append(message.get("body", b""))
                state["more"] = message.get("more_body", False)
            wake.set()

        task = asyncio.ensure_future(self.app(_scope(request), receive, send))
        sent_start = False
        try:
            while True:
                if not pending and state["more"]:
                    if task.done():
                        task.result()  # the app failed before finishing its response
                        raise RuntimeError("the app ended without finishing its response")
                    wake.clear()
                    waiter = asyncio.ensure_future(wake.wait())
                    await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    await asyncio.sleep(0)  # let the app add what it has ready
                    if state["start"] is None:
                        continue
                chunk, more = b"".join(pending), state["more"]
                pending.clear()
                yield (None if sent_start else state["start"], chunk, more)
                sent_start = True
                if not more:
                    break
            await task
        finally:
            if not task.done():
                gone.set()  # the caller went away: the app aborts its request
                try:
                    await asyncio.wait_for(task, 5.0)
                except BaseException:  # noqa: BLE001 - already leaving
                    task.cancel()


def _scope(request: dict) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": request["method"], "scheme": "http", "path": request["path"],
            "raw_path": request["path"].encode(), "root_path": "",
            "query_string": request["query_string"], "headers": request["headers"],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}

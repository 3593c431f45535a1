"""What the event loop holds of an in-flight request: its output stream, and the errors
a request or the engine can end in."""
from __future__ import annotations

import asyncio

from kvserve.outputs import RequestOutput


class EngineRequestError(RuntimeError):
    """The request failed inside the engine (500) or was aborted by the server (503)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down or crashed)."""


class RequestStream:
    """The outputs of one request, read on the event loop. Keeps only the latest.

    ``final_only``: the reader wants the finished output alone (a response that is not
    streamed), so the steps before it do not wake it."""

    __slots__ = ("request_id", "finished", "final_only", "_latest", "_error", "_status",
                 "_event")

    def __init__(self, request_id: str, final_only: bool = False) -> None:
        self.request_id = request_id
        self.final_only = final_only
        self.finished = False
        self._latest: RequestOutput | None = None
        self._error: str | None = None
        self._status = 500
        self._event = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        if self.final_only and not out.finished:
            return
        self._latest = out
        self._event.set()

    def fail(self, message: str, status: int = 500) -> None:
        self._error, self._status = message, status
        self._event.set()

    async def get(self) -> RequestOutput:
        await self._event.wait()
        if self._latest is None:
            raise EngineRequestError(self._error or "request failed", self._status)
        out, self._latest = self._latest, None
        if self._error is None:
            self._event.clear()
        return out

"""The ingress's end of one replica's channel (see ``replica.py``): it submits requests,
reads the batched chunks and hands each request its own, in order.

When the channel fails (the replica's process died, or Ray lost it), every request still
open on it gets a :class:`ReplicaFailed` and the channel is closed; the ingress opens a
new one once the replica answers again.
"""
from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any, Callable


class ReplicaFailed(Exception):
    """The replica's channel broke under open requests; ``cause`` is what Ray raised."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class RequestStream:
    """One request's chunks: ``await get()`` -> ``(start, body, more, error)`` or raises."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> tuple:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class ReplicaChannel:
    def __init__(self, handle: Any,
                 on_failure: Callable[["ReplicaChannel", BaseException], None]) -> None:
        self.id = uuid.uuid4().hex
        self.handle = handle
        self._on_failure = on_failure
        self._open: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self.closed = False
        self._ready = asyncio.Event()  # the replica has the channel (its first, empty item)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            async for items in self.handle.options(stream=True).channel.remote(self.id):
                self._ready.set()
                for rid, head, chunk, more, error in items:
                    stream = self._open.get(rid)
                    if stream is not None:
                        stream.put((head, chunk, more, error))
                        if not more:
                            self._open.pop(rid, None)
            cause: BaseException = RuntimeError("the replica closed its channel")
        except asyncio.CancelledError:
            cause = RuntimeError("the ingress closed the channel")
        except Exception as e:  # noqa: BLE001 - Ray's errors for a lost replica vary
            cause = e
        self._fail(cause)

    def _fail(self, cause: BaseException, report: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        self._ready.set()  # wake submits waiting for the channel: they see it closed
        for stream in self._open.values():
            stream.put(ReplicaFailed(cause))
        self._open.clear()
        if report:
            self._on_failure(self, cause)

    async def submit(self, request: dict) -> tuple[str, RequestStream]:
        """Register the request, then send it. A submit that reaches another process
        than the channel's (Serve replaced the replica meanwhile) is refused there, and
        the channel fails rather than leave the request unread."""
        await self._ready.wait()
        if self.closed:
            raise ReplicaFailed(RuntimeError("the replica's channel is closed"))
        rid = str(next(self._ids))
        stream = self._open[rid] = RequestStream()
        try:
            await self.handle.submit.remote(self.id, rid, request)
        except BaseException as e:
            self.cancel(rid)
            if isinstance(e, Exception) and not isinstance(e, ReplicaFailed):
                self._fail(e)
                raise ReplicaFailed(e) from None
            raise
        return rid, stream

    def cancel(self, rid: str) -> None:
        """The request's client went away: stop its work on the replica."""
        if self._open.pop(rid, None) is not None and not self.closed:
            asyncio.ensure_future(_ignore_errors(self.handle.cancel.remote(self.id, rid)))

    def close(self) -> None:
        """The ingress stops: open requests fail, the replica is not reported down."""
        self._fail(RuntimeError("the ingress is shutting down"), report=False)
        self._reader.cancel()


async def _ignore_errors(call) -> None:
    try:
        await call
    except Exception:  # noqa: BLE001 - a replica gone already dropped the request
        pass

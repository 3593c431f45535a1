"""The one OpenAI-compatible ingress in front of the replicas (an ASGI app).

Every route but three is the replicas' own: the request's method, path, headers and body
go to one replica, which runs the single server's app on them, and its response comes
back as it is sent (streams stay streams). The ingress itself answers:

- ``GET /health``: 200 while at least one replica is up, else 503;
- ``GET /metrics``: every replica's series with a ``replica`` label, plus the router's;
- the API key check (``--api-key``), before anything reaches a replica.

Which replica: the Batch API (``/v1/files``, ``/v1/batches``) always goes to replica 0,
which owns the batch store; ``/v1/stats`` (the dashboard's feed) to ``?replica=N``
(default 0); everything else to the router's choice. A replica that fails under a
request is marked down, that request ends with a 503 (or, mid-stream, an error event
and ``[DONE]``), and a probe brings the replica back once Ray Serve has restarted it.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Sequence
from urllib.parse import parse_qs

from kvserve.config.replicas import ReplicaConfig
from kvserve.entrypoints.openai.errors import APIError, internal_error
from kvserve.logger import init_logger
from kvserve.replicas.channel import ReplicaChannel, ReplicaFailed, RequestStream
from kvserve.replicas.metrics import RouterMetrics, merge_replica_metrics
from kvserve.replicas.prefix_index import block_keys
from kvserve.replicas.routers import ROUTERS, NoReplicaError
from kvserve.replicas.routing_key import routing_prompt

logger = init_logger(__name__)

BATCH_PATHS = ("/v1/files", "/v1/batches")
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 5.0
MULTIPART_SLACK = 1 << 20  # a file upload's form fields around the file itself


class _Stop:
    """Put on a request's stream in place of a chunk: its client left, or shutdown."""

    def __init__(self, error: APIError | None) -> None:
        self.error = error


class Ingress:
    """``handles[i]``: replica i's Ray Serve deployment handle."""

    def __init__(self, handles: Sequence[Any], config: ReplicaConfig, metrics_prefix: str,
                 max_body_bytes: int, max_file_bytes: int) -> None:
        self.handles = list(handles)
        self.channels: list[ReplicaChannel | None] = [None] * len(handles)
        self.router = ROUTERS[config.router](config)
        self.metrics = RouterMetrics(metrics_prefix, len(handles))
        self.loads = [0] * len(handles)
        self.up = [True] * len(handles)
        self.max_body_bytes = max_body_bytes
        self.max_file_bytes = max_file_bytes
        self._active: set[RequestStream] = set()
        self._probe: asyncio.Task | None = None

    # -- ASGI --------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        try:
            if path == "/health" and method == "GET":
                await self._health(send)
            elif path == "/metrics" and method == "GET":
                await self._metrics(send)
            else:
                await self._forward(scope, receive, send)
        except APIError as e:
            await e.response()(scope, receive, send)
        except Exception:  # noqa: BLE001 - one failed request, not a dead ingress
            logger.exception("%s %s failed at the ingress", method, path)
            await internal_error().response()(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._probe is not None:
                    self._probe.cancel()
                for channel in self.channels:
                    if channel is not None:
                        channel.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    @property
    def num_in_flight(self) -> int:
        return sum(self.loads)

    def abort_all(self, reason: str) -> None:
        """End every forwarded request now (graceful shutdown's deadline)."""
        for stream in list(self._active):
            stream.put(_Stop(APIError(reason, 503, code="server_shutting_down")))

    # -- replica health ----------------------------------------------------------------
    def _set_up(self, replica: int, up: bool) -> None:
        if self.up[replica] != up:
            logger.warning("replica %d is %s", replica, "back up" if up else "down")
            if up:
                self.router.index.forget(replica)  # a restarted replica's cache is empty
        self.up[replica] = up
        self.metrics.up.labels(str(replica)).set(1 if up else 0)
        if not up and (self._probe is None or self._probe.done()):
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    def _channel(self, replica: int) -> ReplicaChannel:
        channel = self.channels[replica]
        if channel is None or channel.closed:
            channel = self.channels[replica] = ReplicaChannel(
                self.handles[replica], lambda ch, cause: self._channel_failed(replica, ch, cause))
        return channel

    def _channel_failed(self, replica: int, channel: ReplicaChannel,
                        cause: BaseException) -> None:
        logger.error("replica %d's channel failed: %r", replica, cause)
        if self.channels[replica] is channel:
            self._set_up(replica, False)

    async def _probe_loop(self) -> None:
        """Runs while a replica is down: it is up again once its health check answers."""
        async def probe(i: int) -> None:
            try:
                await asyncio.wait_for(self.handles[i].check_health.remote(), PROBE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - still restarting
                return
            self._set_up(i, True)

        while not all(self.up):
            await asyncio.sleep(PROBE_INTERVAL_S)
            await asyncio.gather(*(probe(i) for i, up in enumerate(self.up) if not up))

    async def _health(self, send) -> None:
        if not any(self.up):
            raise APIError("no replica is up (they are restarting)", 503)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def _metrics(self, send) -> None:
        request = {"method": "GET", "path": "/metrics", "query_string": b"",
                   "headers": [], "body": b""}

        async def one(i: int) -> str | None:
            try:
                status, _, body = await asyncio.wait_for(self._collect(i, request),
                                                         PROBE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a replica down shows as replica_up 0
                return None
            return body.decode() if status == 200 else None
        up = [i for i in range(len(self.handles)) if self.up[i]]
        texts = await asyncio.gather(*(one(i) for i in up))
        body = merge_replica_metrics({i: t for i, t in zip(up, texts) if t is not None},
                                     self.metrics)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
        await send({"type": "http.response.body", "body": body})

    async def _collect(self, replica: int, request: dict) -> tuple[int, list, bytes]:
        channel = self._channel(replica)
        rid, stream = await channel.submit(request)
        start, parts = None, []
        try:
            while True:
                head, chunk, more, error = await stream.get()
                if error:
                    raise RuntimeError(error)
                start = start or head
                parts.append(chunk)
                if not more:
                    return start[0], start[1], b"".join(parts)
        finally:
            channel.cancel(rid)  # a no-op once finished; else (a timeout) stops it

    # -- forwarding --------------------------------------------------------------------
    async def _read_body(self, path: str, receive) -> bytes:
        limit = (self.max_file_bytes + MULTIPART_SLACK if path.startswith("/v1/files")
                 else self.max_body_bytes)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise APIError("client disconnected while sending the body", 400)
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > limit:
                raise APIError(f"request body exceeds the limit of {limit} bytes", 413,
                               code="request_too_large")
            if not message.get("more_body", False):
                return b"".join(parts)

    def _choose(self, scope, body: bytes) -> int:
        path = scope["path"]
        if path.startswith(BATCH_PATHS) or path == "/v1/stats":
            replica = 0
            if path == "/v1/stats":
                query = parse_qs(scope.get("query_string", b"").decode())
                wanted = query.get("replica", ["0"])[0]
                if not (wanted.isascii() and wanted.isdecimal()) \
                        or int(wanted) >= len(self.handles):
                    raise APIError(f"replica must be an integer in [0, {len(self.handles)}), "
                                   f"got {wanted!r}", 400, param="replica")
                replica = int(wanted)
            if not self.up[replica]:
                raise APIError(f"replica {replica} is restarting; retry shortly", 503)
            return replica
        keys = block_keys(routing_prompt(path, body))
        try:
            decision = self.router.route(keys, self.loads, self.up)
        except NoReplicaError as e:
            raise APIError(str(e), 503) from None
        self.metrics.decisions.labels(str(decision.replica), decision.reason).inc()
        if keys:
            self.metrics.match_ratio.observe(decision.match_ratio)
        return decision.replica

    async def _forward(self, scope, receive, send) -> None:
        body = await self._read_body(scope["path"], receive)
        replica = self._choose(scope, body)
        request = {"method": scope["method"], "path": scope["path"], "body": body,
                   "query_string": scope.get("query_string", b""),
                   "headers": [(k, v) for k, v in scope["headers"] if k != b"authorization"]}
        self.loads[replica] += 1
        self.metrics.in_flight.labels(str(replica)).inc()
        try:
            await self._relay(replica, request, receive, send)
        finally:
            self.loads[replica] -= 1
            self.metrics.in_flight.labels(str(replica)).dec()

    async def _relay(self, replica: int, request: dict, receive, send) -> None:
        channel = self._channel(replica)
        try:
            rid, stream = await channel.submit(request)
        except ReplicaFailed as e:
            await self._fail(send, False, False, self._replica_error(replica, channel, e))
            return
        self._active.add(stream)
        watcher = asyncio.ensure_future(_put_on_disconnect(receive, stream))
        is_sse = started = done = False
        try:
            while True:
                try:
                    item = await stream.get()
                except ReplicaFailed as e:
                    done = True
                    await self._fail(send, started, is_sse,
                                     self._replica_error(replica, channel, e))
                    return
                if isinstance(item, _Stop):
                    if item.error is not None:
                        await self._fail(send, started, is_sse, item.error)
                    return
                head, chunk, more, error = item
                if error:
                    done = True
                    self.metrics.failures.labels(str(replica)).inc()
                    logger.error("replica %d failed a request: %s", replica, error)
                    await self._fail(send, started, is_sse,
                                     internal_error(f"replica {replica} failed this request"))
                    return
                if head is not None:
                    status, headers = head
                    is_sse = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                 for k, v in headers)
                    await send({"type": "http.response.start", "status": status,
                                "headers": headers})
                    started = True
                done = not more
                await send({"type": "http.response.body", "body": chunk, "more_body": more})
                if done:
                    return
        finally:
            watcher.cancel()
            self._active.discard(stream)
            if not done:  # the client left, a shutdown, or this task was cancelled
                channel.cancel(rid)  # the replica sees a disconnect and aborts

    def _replica_error(self, replica: int, channel: ReplicaChannel,
                       failure: ReplicaFailed) -> APIError:
        self.metrics.failures.labels(str(replica)).inc()
        if self.channels[replica] is channel:  # not a stale failure of a replaced channel
            self._set_up(replica, False)
        logger.error("replica %d failed under a request: %s", replica, failure.cause)
        return APIError(f"replica {replica} died or became unreachable while serving this "
                        f"request; it is being restarted, retry the request", 503,
                        code="replica_died")

    @staticmethod
    async def _fail(send, started: bool, is_sse: bool, error: APIError) -> None:
        if not started:
            await send({"type": "http.response.start", "status": error.status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": json.dumps(error.body()).encode()})
            return
        tail = (error.sse() + "data: [DONE]\n\n").encode() if is_sse else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _put_on_disconnect(receive, stream: RequestStream) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    stream.put(_Stop(None))

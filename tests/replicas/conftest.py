"""The replica stack in one process: EngineReplicas behind handles that stand in for Ray
Serve's, so the ingress, the router and the ASGI bridge are tested without Ray."""
from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve.config import EngineArgs, ObservabilityConfig
from kvserve.replicas.replica import EngineReplica


class _Call:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _Stream:
    """A DeploymentResponseGenerator's surface: async iteration and ``cancel()``."""

    def __init__(self, agen, fail_after: int | None) -> None:
        self.agen, self.fail_after, self.items = agen, fail_after, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.fail_after is not None and self.items >= self.fail_after:
            from ray.exceptions import RayActorError
            await self.agen.aclose()  # the process is gone: so is its request
            raise RayActorError()
        self.items += 1
        return await self.agen.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self.agen.aclose())


class InProcessHandle:
    """A DeploymentHandle to an EngineReplica living in this process. ``fail_after``:
    streams raise Ray's actor-death error after that many items; ``healthy``: what
    ``check_health`` answers."""

    def __init__(self, replica: EngineReplica) -> None:
        self.replica = replica
        self.fail_after: int | None = None
        self.healthy = True
        self.requests: list[dict] = []

    def options(self, stream: bool = False):
        return self

    @property
    def handle(self):
        def start(request):
            self.requests.append(request)
            return _Stream(self.replica.handle(request), self.fail_after)
        return _Call(start)

    @property
    def check_health(self):
        async def check():
            if not self.healthy:
                raise RuntimeError("restarting")
            await self.replica.check_health()
        return _Call(check)


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: the replicas' engines bind to the loop they start on."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture(scope="module")
def run(loop):
    def run(coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)
    return run


@pytest.fixture(scope="module")
def replicas(llama_dir, run):
    """Two replicas of the tiny llama, as the launcher builds them."""
    settings = dict(served_model_name="llama", max_waiting=64, max_body_bytes=1 << 20,
                    tool_call_parser="hermes", batch=None)
    built = [EngineReplica(i, EngineArgs(model=llama_dir, num_threads=1, max_num_seqs=8),
                           ObservabilityConfig(served_model_name="llama", log_stats_interval=0),
                           settings) for i in range(2)]
    yield built
    for r in built:
        if r._lifespan is not None:
            run(r._lifespan.__aexit__(None, None, None))

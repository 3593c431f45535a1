"""The replica stack in one process: EngineReplicas behind handles that stand in for Ray
Serve's, so the ingress, the router and the ASGI bridge are tested without Ray."""
from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve.config import ObservabilityConfig
from kvserve.engine.engine_args import EngineArgs
from kvserve.replicas.replica import EngineReplica


class _Call:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _Stream:
    """A DeploymentResponseGenerator's surface: async iteration."""

    def __init__(self, agen, handle: "InProcessHandle") -> None:
        self.agen, self.handle = agen, handle

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.handle.dead:
            from ray.exceptions import RayActorError
            await self.agen.aclose()  # the process is gone: so are its requests
            raise RayActorError()
        item = await self.agen.__anext__()
        self.handle.items += 1
        if self.handle.fail_after is not None and self.handle.items >= self.handle.fail_after:
            self.handle.dead = True
        return item


class InProcessHandle:
    """A DeploymentHandle to an EngineReplica living in this process. Setting ``dead``,
    or ``fail_after`` (channel items), makes its channel raise Ray's actor-death error
    as a killed process's would; ``healthy`` is what ``check_health`` answers."""

    def __init__(self, replica: EngineReplica) -> None:
        self.replica = replica
        self.fail_after: int | None = None
        self.dead = False
        self.items = 0
        self.healthy = True
        self.requests: list[dict] = []

    def options(self, stream: bool = False):
        return self

    @property
    def channel(self):
        return _Call(lambda channel_id: _Stream(self.replica.channel(channel_id), self))

    @property
    def submit(self):
        async def submit(channel_id, rid, request):
            self.requests.append(request)
            await self.replica.submit(channel_id, rid, request)
        return _Call(submit)

    @property
    def cancel(self):
        return _Call(self.replica.cancel)

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
    built = []
    for i in range(2):  # as Serve builds one: a bare instance, then its awaited __init__
        replica = EngineReplica.__new__(EngineReplica)
        run(replica.__init__(i, EngineArgs(model=llama_dir, num_threads=1, max_num_seqs=8),
                             ObservabilityConfig(served_model_name="llama",
                                                 log_stats_interval=0), settings))
        built.append(replica)
    yield built
    for replica in built:
        run(replica.__del__())

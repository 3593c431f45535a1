"""BatchRunner: runs the lines of in-progress batches as background requests.

It lives on the server's event loop. Each pass it looks at the active batches in the
store (oldest first): it closes those cancelled, expired or done, and starts lines of
the others while fewer than the bound are in flight. A line is executed through the
server's own completions / chat handlers (same validation, same response bodies) as a
background request, which the scheduler ranks below every realtime request; its result
is committed before the line counts as done. A line that could not run now (the server
busy or shutting down) stays queued and runs later, or after a restart.

The bound adapts to realtime load: all of ``max_in_flight`` while no realtime request is
in flight, and as many slots as ``max_num_seqs`` leaves after twice the realtime
requests otherwise (at least one, so the batch always progresses).
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from kvserve.batch.lines import InputLine
from kvserve.batch.store import BatchStore
from kvserve.logger import init_logger

logger = init_logger(__name__)

RETRY_STATUSES = (429, 503)  # busy or shutting down: the line runs later
POLL_S = 0.5

Execute = Callable[[str, dict], Awaitable[tuple[int, str, object]]]


class BatchRunner:
    def __init__(self, store: BatchStore, execute: Execute, realtime_in_flight: Callable[[], int],
                 max_in_flight: int = 64, max_num_seqs: int = 128, metrics=None) -> None:
        self.store = store
        self.execute = execute
        self.realtime_in_flight = realtime_in_flight
        self.max_in_flight = max_in_flight
        self.max_num_seqs = max_num_seqs
        self.metrics = metrics
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}
        self._wake = asyncio.Event()
        self.done = self.failed = 0  # lines finished since the server started

    # -- what others ask -----------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def bound(self) -> int:
        realtime = self.realtime_in_flight()
        if realtime == 0:
            return self.max_in_flight
        return max(1, min(self.max_in_flight, self.max_num_seqs - 2 * realtime))

    def wake(self) -> None:
        self._wake.set()

    def counts(self) -> dict:
        queued = sum(b["request_counts"]["total"] - b["request_counts"]["completed"]
                     - b["request_counts"]["failed"] for b in self.store.active())
        return {"queued": max(0, queued - self.in_flight), "running": self.in_flight,
                "done": self.done, "failed": self.failed}

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                self.step()
            except Exception:  # noqa: BLE001 - one bad pass must not stop batches for good
                logger.exception("batch runner pass failed")
            if self.metrics is not None:
                counts = self.counts()
                self.metrics.batch_lines["queued"].set(counts["queued"])
                self.metrics.batch_lines["running"].set(counts["running"])
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass

    def step(self) -> None:
        now = time.time()
        for batch in self.store.active():
            bid, status = batch["id"], batch["status"]
            mine = [key for key in self._tasks if key[0] == bid]
            if status == "in_progress" and now >= batch["expires_at"]:
                self._cancel(mine)
                status = "expired"
            if status in ("cancelling", "expired"):
                self._cancel(mine)
                if not any(key in self._tasks for key in mine):
                    self.store.finalize(bid, "cancelled" if status == "cancelling" else status)
                continue
            if status == "finalizing" or (not mine and not self.store.num_queued(bid)):
                self.store.set_status(bid, "finalizing")
                self.store.finalize(bid, "completed")
                logger.info("batch %s completed: %s", bid, batch["request_counts"])
                continue
            free = self.bound() - len(self._tasks)
            if free > 0:
                for line in self.store.queued_lines(bid, free, {k[1] for k in mine}):
                    self._start(bid, batch["endpoint"], line)

    def _start(self, batch_id: str, endpoint: str, line: InputLine) -> None:
        key = (batch_id, line.line)
        task = asyncio.get_running_loop().create_task(self._run_line(batch_id, endpoint, line))
        self._tasks[key] = task
        task.add_done_callback(lambda _: (self._tasks.pop(key, None), self.wake()))

    def _cancel(self, keys) -> None:
        for key in keys:
            task = self._tasks.get(key)
            if task is not None:
                task.cancel()

    async def _run_line(self, batch_id: str, endpoint: str, line: InputLine) -> None:
        try:
            status, request_id, body = await self.execute(endpoint, line.body)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the line fails, the batch goes on
            logger.exception("batch %s line %d failed", batch_id, line.line)
            status, request_id, body = 500, "", {"error": {
                "message": f"internal error: {type(e).__name__}", "type": "server_error",
                "param": None, "code": None}}
        if status in RETRY_STATUSES:
            await asyncio.sleep(POLL_S)  # stays queued; a later pass starts it again
            return
        self.store.record(batch_id, line.line, status, request_id, body)
        ok = 200 <= status < 300
        self.done += ok
        self.failed += not ok
        if self.metrics is not None:
            self.metrics.batch_lines_finished["completed" if ok else "failed"].inc()

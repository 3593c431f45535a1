"""The engine thread's half of :class:`~kvserve.engine.async_engine.AsyncLLMEngine`.

One thread owns the LLMEngine. It sleeps on a condition while there is nothing to do,
applies the commands the event loop queued (adds, aborts, adapter changes) between steps, runs the
steps, and posts their outputs back to the event loop without waiting for it. Every
method here runs on that thread; what it hands the event loop goes through
:meth:`EngineLoop._post`.

State shared with the event-loop half (set up by AsyncLLMEngine): ``_cv`` guards
``_cmds`` and ``_stop``; ``_live`` and ``_final_only`` belong to this thread alone;
``snapshot`` is replaced whole, never mutated, so the event loop reads it without a lock.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

from kvserve.engine.llm_engine import PromptType
from kvserve.logger import init_logger
from kvserve.lora.request import LoRARequest
from kvserve.metrics import EngineSnapshot
from kvserve.sampling_params import SamplingParams
from kvserve.worker import WorkerDiedError

logger = init_logger(__name__)

BURST_GAP_S = 0.002   # a burst of adds has ended when none came for this long ...
BURST_MAX_S = 0.02    # ... or after this long
PUBLISH_INTERVAL_S = 0.05  # the engine state the server reads may be this old mid-burst


@dataclass
class AddCommand:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    arrival_time: float
    future: asyncio.Future
    trace_headers: dict | None = None
    background: bool = False
    final_only: bool = False
    lora_request: LoRARequest | None = None


@dataclass
class AbortCommand:
    request_ids: list[str]


@dataclass
class CallCommand:
    """``fn(engine)`` run on the engine thread between steps (adapters added, removed);
    its result or exception goes to ``future``."""

    fn: Callable
    future: asyncio.Future


def _resolve(fut: asyncio.Future, exc: BaseException | None, result=None) -> None:
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(result)


class EngineLoop:
    """The loop's methods; AsyncLLMEngine inherits them and holds the state."""

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _wait_and_run(self) -> None:
        self._go.wait()
        if self._loop is not None:  # None: shut down before it was ever started
            self._run()

    def _run(self) -> None:
        busy, failures = False, 0
        while True:
            try:
                busy, stop = self._iteration(busy)
                failures = 0
                if stop:
                    return
            except WorkerDiedError as e:  # nothing can run again: stop now
                self._die(f"the engine stopped: {e}")
                return
            except Exception as e:  # a bug outside the model step: fail what is in flight
                failures += 1
                logger.exception("engine loop iteration failed; failing in-flight requests")
                if failures >= 3:
                    self._die(f"the engine loop died: {type(e).__name__}: {e}")
                    return
                try:
                    self._abort_all("internal error in the engine loop")
                except Exception:  # noqa: BLE001 - the next iteration reports it
                    logger.exception("aborting in-flight requests failed")
                busy = False

    def _iteration(self, busy: bool) -> tuple[bool, bool]:
        with self._cv:
            if not self._cmds and not busy and not self._stop:
                self._cv.wait(timeout=self._idle_wait)
            if not busy and len(self._cmds) > 1:
                self._gather_burst()
            cmds, self._cmds = self._cmds, []
            stop = self._stop
        if cmds:
            resolved = []
            try:
                resolved = [self._apply(cmd) for cmd in cmds]
                # before answering adds, so backpressure sees them; in full once idle (an
                # abort emptied the engine: no step follows to publish it)
                self._publish(full=not self.engine.has_unfinished_requests())
            finally:
                done = {id(r[0]) for r in resolved if r is not None}
                for r in resolved:
                    if r is not None:
                        self._post(_resolve, *r)
                for cmd in cmds:  # never leave an add unanswered, whatever failed
                    if isinstance(cmd, (AddCommand, CallCommand)) and id(cmd.future) not in done:
                        self._post(_resolve, cmd.future, RuntimeError("engine loop failed"))
        if stop:
            self._abort_all("the server is shutting down")
            return False, True
        if self.engine.has_unfinished_requests():
            self._step()
        self._stats.maybe_log(self.snapshot)
        return self.engine.has_unfinished_requests(), False

    def _gather_burst(self) -> None:
        """An idle engine woken by several adds at once (a batch, a client's burst) waits
        while more keep coming, briefly: its first step then takes them together, as
        LLM.generate's does, instead of a trickle of small prefills. A lone request does
        not wait. Called holding the condition."""
        deadline = time.monotonic() + BURST_MAX_S
        while time.monotonic() < deadline and not self._stop:
            seen = len(self._cmds)
            self._cv.wait(BURST_GAP_S)
            if len(self._cmds) == seen:
                return

    def _apply(self, cmd: AddCommand | AbortCommand | CallCommand):
        if isinstance(cmd, CallCommand):
            try:
                return cmd.future, None, cmd.fn(self.engine)
            except Exception as e:  # noqa: BLE001 - the caller's to report
                return cmd.future, e
        if isinstance(cmd, AbortCommand):
            live = [r for r in cmd.request_ids if r in self._live]
            if live:
                for rid in live:
                    self._live.discard(rid)
                    self._final_only.discard(rid)
                    self._stats.on_abort(rid)
                self.engine.abort_request(live)
            return None
        if cmd.future.cancelled():
            return None
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                    arrival_time=cmd.arrival_time, priority=cmd.priority,
                                    background=cmd.background, lora_request=cmd.lora_request)
        except Exception as e:  # ValueError: the client's mistake; others: ours
            return cmd.future, e
        self._stats.on_add(cmd.request_id, cmd.params, cmd.arrival_time, cmd.trace_headers)
        self._live.add(cmd.request_id)
        if cmd.final_only:
            self._final_only.add(cmd.request_id)
        return cmd.future, None

    def _die(self, error: str) -> None:
        self.dead_error = error
        self._post(self._fail_streams, list(self._live), error, 503)
        self._stats.on_state(self.snapshot, alive=False)
        if self.on_dead is not None:
            self._post(self.on_dead)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerDiedError:
            raise
        except Exception:
            logger.exception("engine step failed; failing the %d in-flight requests",
                             len(self._live))
            self._abort_all("internal error while running the engine step")
            return
        now = time.monotonic()
        self._stats.on_step(self.engine.last_step_stats, self.engine.last_step_preempted, now)
        self._stats.on_outputs(outputs, now)
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        idle = not self.engine.has_unfinished_requests()
        self._publish(at_most_every=0.0 if idle else PUBLISH_INTERVAL_S)
        # a response that is not streamed waits for its last output: the event loop is
        # not woken (nor the engine's cores disturbed) for the ones before
        post = [o for o in outputs if o.finished or o.request_id not in self._final_only]
        for out in post:
            if out.finished:
                self._final_only.discard(out.request_id)
        if post:
            self._post(self._deliver, post)
        if self.engine.last_step_stats is None:  # nothing ran (e.g. a batching window):
            with self._cv:                       # don't spin, but wake at once for commands
                if not self._cmds and not self._stop:
                    self._cv.wait(0.002)

    def _abort_all(self, message: str) -> None:
        ids = list(self._live)
        try:
            if ids:
                self.engine.abort_request(ids)
        finally:
            for rid in ids:
                self._stats.on_abort(rid)
            self._live.clear()
            self._final_only.clear()
            self._publish()
            self._post(self._fail_streams, ids, message)

    def _publish(self, full: bool = True, at_most_every: float = 0.0) -> None:
        """Read the engine's state for the server and the recorder: the queue sizes
        (what backpressure reads) every time, the full state (its KV snapshot walks every
        block table) when ``full`` and not within ``at_most_every`` seconds of the last,
        so the recorder samples the state as steps leave it."""
        now = time.monotonic()
        if not full or now - self._published < at_most_every:
            running, waiting = self.engine.queue_sizes()
            self.snapshot = dataclasses.replace(self.snapshot, num_running=running,
                                                num_waiting=waiting)
            return
        self._published = now
        self.snapshot = snap = EngineSnapshot.of(self.engine.get_stats())
        self._stats.on_state(snap)

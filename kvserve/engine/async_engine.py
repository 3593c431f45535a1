"""AsyncLLMEngine: the synchronous LLMEngine driven from one thread, for asyncio servers.

The engine is not thread-safe, so exactly one thread (``kvserve-engine``) touches it.
Built with :meth:`AsyncLLMEngine.from_engine_args`, that thread also loads the model, so
every OpenMP parallel region of the process runs on it (with async scheduling, on the
model thread it starts: :mod:`kvserve.worker.model_thread`). Why it matters: libgomp keeps one
worker team per thread that ever ran a parallel region, and once its teams hold more
threads than there are cores it stops letting idle workers spin between regions; each of
a decode step's many small ops then waits for a sleeping worker to wake. Loading on the
main thread and stepping on another made server decode steps much slower than offline
ones (measured: docs/performance.md).

That thread loops ``step()`` while requests exist and sleeps on a condition otherwise;
adds and aborts reach it through a command list applied between steps. Each step's
outputs go back to the event loop with ``call_soon_threadsafe`` into one
:class:`RequestStream` per request. Outputs are cumulative, so a stream keeps only
the latest one: a slow reader never makes memory grow, it just gets bigger deltas.

Overlap: while the engine thread runs a step (torch releases the GIL during compute),
the event loop parses and validates requests, renders chat templates, tokenizes
prompts, turns outputs into deltas and serializes the JSON / SSE of the previous step.
Outputs are posted without waiting, so the next step starts at once. With async
scheduling the model computes on a thread of its own and the next step is already
running while this thread makes a step's outputs (:meth:`LLMEngine.step`).

An abort (client gone) is applied before the next step, which frees the request's KV
blocks at once. A failing step fails the requests in it (the engine reports
``error``); an unexpected exception in the loop fails every in-flight request and the
loop goes on, so one bad request never takes the server down.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from kvserve.config import EngineArgs, ObservabilityConfig
from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.engine.streams import EngineDeadError, RequestStream
from kvserve.logger import init_logger
from kvserve.metrics import EngineSnapshot, StatsRecorder, create_recorder
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.worker import WorkerDiedError

logger = init_logger(__name__)

BURST_GAP_S = 0.002   # a burst of adds has ended when none came for this long ...
BURST_MAX_S = 0.02    # ... or after this long
PUBLISH_INTERVAL_S = 0.05  # the engine state the server reads may be this old mid-burst


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    arrival_time: float
    future: asyncio.Future
    trace_headers: dict | None = None
    background: bool = False
    final_only: bool = False


@dataclass
class _Abort:
    request_ids: list[str]


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(None)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, recorder: StatsRecorder | None = None) -> None:
        """``recorder``: what observes the engine (metrics, live stats, traces); its
        methods run on the engine thread."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.max_num_seqs = engine.config.scheduler.max_num_seqs
        self.snapshot = EngineSnapshot()
        self._stats = recorder or StatsRecorder(None, log_interval=0)
        self.metrics, self.live = self._stats.metrics, self._stats.live
        interval = self._stats.log_interval
        self._idle_wait = min(interval, 1.0) if interval > 0 else 1.0
        self._cv = threading.Condition()
        self._cmds: list[_Add | _Abort] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side
        self._pending_adds = 0  # event-loop side
        self._live: set[str] = set()  # engine-thread side
        self._final_only: set[str] = set()  # engine-thread side: posted only once finished
        self._published = 0.0
        self.dead_error: str | None = None
        self.on_dead = None  # called on the event loop once the engine died for good
        self._go = threading.Event()  # start() was called: a waiting engine thread may run

    @classmethod
    def from_engine_args(cls, args: EngineArgs,
                         observability: ObservabilityConfig | None = None) -> "AsyncLLMEngine":
        """Build the LLMEngine (and the recorder ``observability`` asks for) on the
        engine thread; it then waits for :meth:`start`.

        Blocks until the model is loaded and re-raises whatever loading raised.
        """
        made: concurrent.futures.Future[AsyncLLMEngine] = concurrent.futures.Future()

        def boot() -> None:
            try:
                engine = LLMEngine(args)
                recorder = create_recorder(observability, engine) if observability else None
                made.set_result(cls(engine, recorder))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                made.set_exception(e)
                return
            made.result()._wait_and_run()

        thread = threading.Thread(target=boot, name="kvserve-engine", daemon=True)
        thread.start()
        engine = made.result()
        engine._thread = thread
        return engine

    # -- lifecycle (event loop) ----------------------------------------------------------

    def start(self, hold: bool = False) -> None:
        """Start the engine loop; call from the event loop that will read the streams.
        ``hold``: requests may be added, but no step runs before :meth:`release` (an
        offline batch whose first step should see all of its requests)."""
        self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = threading.Thread(target=self._wait_and_run, name="kvserve-engine",
                                            daemon=True)
            self._thread.start()
        if not hold:
            self._go.set()

    def release(self) -> None:
        """Let a held engine run."""
        self._go.set()

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stop
                and self.dead_error is None)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is still in flight and stop the engine thread."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._go.set()
        if self._thread is not None and self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout)
        self._fail_streams(list(self._streams), "the server is shutting down", 503)
        if self._stats.tracer is not None:
            self._stats.tracer.shutdown()  # sends the spans still batched

    # -- requests (event loop) -----------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the scheduler's waiting queue plus adds in transit."""
        return self.snapshot.num_waiting + self._pending_adds

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None,
                          trace_headers: dict | None = None, background: bool = False,
                          final_only: bool = False) -> RequestStream:
        """Queue a request; raises ValueError (bad prompt / params) as the engine does.
        ``trace_headers``: the caller's W3C trace context (traceparent), for its span;
        ``background``: a batch line (the scheduler's lowest class); ``final_only``: the
        stream yields the finished output alone."""
        if not self.is_running:
            raise EngineDeadError(self.dead_error or "the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream(request_id, final_only)
        fut = self._loop.create_future()
        self._pending_adds += 1
        self._send(_Add(request_id, prompt, params, priority,
                        arrival_time or time.monotonic(), fut, trace_headers, background,
                        final_only))
        try:
            await fut
        except BaseException as e:
            self._streams.pop(request_id, None)
            if isinstance(e, asyncio.CancelledError):  # the add may still land: undo it
                self._send(_Abort([request_id]))
            raise
        finally:
            self._pending_adds -= 1
        return stream

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """The engine's prompt checks (they read only settings fixed at start, so any
        thread may run them); returns the resolved max_tokens, raises ValueError."""
        return self.engine.validate_prompt(token_ids, params)

    async def stream_outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until finished; leaving early aborts the request."""
        try:
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    return
        finally:
            self.abort(stream.request_id)

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params, priority)
        async for out in self.stream_outputs(stream):
            yield out

    def abort(self, request_ids: str | list[str]) -> None:
        """Abort unfinished requests (a no-op for finished or unknown ones)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        live = [r for r in ids if r in self._streams]
        for rid in live:
            self._streams.pop(rid).finished = True
        if live:
            self._send(_Abort(live))

    def abort_all(self, message: str = "the server is shutting down") -> None:
        """Abort every in-flight request; their readers get a 503 EngineRequestError."""
        ids = list(self._streams)
        if ids:
            self._send(_Abort(ids))
            self._fail_streams(ids, message, 503)

    def _send(self, cmd: _Add | _Abort) -> None:
        with self._cv:
            self._cmds.append(cmd)
            self._cv.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if out.finished:
                del self._streams[out.request_id]
                stream.finished = True
            if out.error:
                stream.fail(out.error)
            else:
                stream.put(out)

    def _fail_streams(self, request_ids: list[str], message: str, status: int = 500) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.finished = True
                stream.fail(message, status)

    # -- the engine thread ---------------------------------------------------------------

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
                    if isinstance(cmd, _Add) and id(cmd.future) not in done:
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

    def _apply(self, cmd: _Add | _Abort):
        if isinstance(cmd, _Abort):
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
                                    background=cmd.background)
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

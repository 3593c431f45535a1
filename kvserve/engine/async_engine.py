"""AsyncLLMEngine: the synchronous LLMEngine driven from one thread, for asyncio servers.

The engine is not thread-safe, so exactly one thread (``kvserve-engine``) touches it.
The model loads and computes on kvserve's compute thread
(:mod:`kvserve.worker.compute_thread`), so every OpenMP parallel region of the engine runs
on one team. Why it matters: libgomp keeps one worker team per thread that ever ran a
parallel region, and once its teams hold more threads than there are cores it stops
letting idle workers spin between regions; each of a decode step's many small ops then
waits for a sleeping worker to wake.

That thread loops ``step()`` while requests exist and sleeps on a condition otherwise;
adds and aborts reach it through a command list applied between steps. Each step's
outputs go back to the event loop with ``call_soon_threadsafe`` into one
:class:`RequestStream` per request. Outputs are cumulative, so a stream keeps only
the latest one: a slow reader never makes memory grow, it just gets bigger deltas.

Overlap: while the engine thread runs a step (torch releases the GIL during compute),
the event loop parses and validates requests, renders chat templates, tokenizes
prompts, turns outputs into deltas and serializes the JSON / SSE of the previous step.
Outputs are posted without waiting, so the next step starts at once. With async
scheduling the next step is already running on the compute thread while this thread
makes a step's outputs (:meth:`LLMEngine.step`).

An abort (client gone) is applied before the next step, which frees the request's KV
blocks at once. A failing step fails the requests in it (the engine reports
``error``); an unexpected exception in the loop fails every in-flight request and the
loop goes on, so one bad request never takes the server down.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import AsyncIterator

from kvserve.config import ObservabilityConfig
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.engine.engine_loop import AbortCommand, AddCommand, CallCommand, EngineLoop
from kvserve.engine.streams import EngineDeadError, RequestStream
from kvserve.lora.request import LoRARequest
from kvserve.metrics import EngineSnapshot, StatsRecorder, create_recorder
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


class AsyncLLMEngine(EngineLoop):
    def __init__(self, engine: LLMEngine, recorder: StatsRecorder | None = None) -> None:
        """``recorder``: what observes the engine (metrics, live stats, traces); its
        methods run on the engine thread."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.sampling_defaults = engine.config.model.sampling_defaults
        self.vocab_size = engine.vocab_size
        self.max_num_seqs = engine.config.scheduler.max_num_seqs
        self.snapshot = EngineSnapshot()
        self._stats = recorder or StatsRecorder(None, log_interval=0)
        self.metrics, self.live = self._stats.metrics, self._stats.live
        self.kernel_build = engine.kernel_build()
        if self.metrics is not None:
            self.metrics.kernels_compiled.set(1 if self.kernel_build.compiled else 0)
        interval = self._stats.log_interval
        self._idle_wait = min(interval, 1.0) if interval > 0 else 1.0
        self._cv = threading.Condition()
        self._cmds: list[AddCommand | AbortCommand] = []
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
                          final_only: bool = False, lora_request: LoRARequest | None = None
                          ) -> RequestStream:
        """Queue a request; raises ValueError (bad prompt / params) as the engine does.
        ``trace_headers``: the caller's W3C trace context (traceparent), for its span;
        ``background``: a batch line (the scheduler's lowest class); ``final_only``: the
        stream yields the finished output alone; ``lora_request``: its adapter."""
        if not self.is_running:
            raise EngineDeadError(self.dead_error or "the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream(request_id, final_only)
        fut = self._loop.create_future()
        self._pending_adds += 1
        self._send(AddCommand(request_id, prompt, params, priority,
                        arrival_time or time.monotonic(), fut, trace_headers, background,
                        final_only, lora_request))
        try:
            await fut
        except BaseException as e:
            self._streams.pop(request_id, None)
            if isinstance(e, asyncio.CancelledError):  # the add may still land: undo it
                self._send(AbortCommand([request_id]))
            raise
        finally:
            self._pending_adds -= 1
        return stream

    async def call_engine(self, fn):
        """``fn(engine)`` on the engine thread between steps; its result (or raise)."""
        if not self.is_running:
            raise EngineDeadError(self.dead_error or "the engine is not running")
        fut = self._loop.create_future()
        self._send(CallCommand(fn, fut))
        return await fut

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self.call_engine(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.call_engine(lambda engine: engine.remove_lora(lora_int_id))

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
            self._send(AbortCommand(live))

    def abort_all(self, message: str = "the server is shutting down") -> None:
        """Abort every in-flight request; their readers get a 503 EngineRequestError."""
        ids = list(self._streams)
        if ids:
            self._send(AbortCommand(ids))
            self._fail_streams(ids, message, 503)

    def _send(self, cmd: AddCommand | AbortCommand) -> None:
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

"""LLMEngine: the synchronous step loop over a scheduler, a KV manager and a worker.

add_request -> step() ... -> RequestOutputs. One step schedules a flat batch, has the
worker run the model on it, advances the scheduler with the sampled tokens (the
scheduler decides which requests are finished) and turns the tokens into text. The
engine reads nothing of the platform: threads, kernels, memory and warm-up are the
worker's. It is not thread-safe; the async engine drives it from one thread.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import Future

from kvserve.config import EngineConfig
from kvserve.engine.engine_args import EngineArgs
from kvserve.core.kv import create_kv_manager
from kvserve.core.kv.groups import engine_kv_groups
from kvserve.core.scheduler import Scheduler
from kvserve.core.scheduler_output import SchedulerOutput, SchedulerStats
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.prompts import PromptType, read_prompt_file, stop_token_ids, \
    tokenize_prompt, validate_prompt
from kvserve.logger import init_logger
from kvserve.lora.registry import LoRARegistry
from kvserve.lora.request import LoRARequest
from kvserve.model.tokenizer import Tokenizer
from kvserve.outputs import RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.model.pooling_config import read_pooling_config
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.controller import SpecDecodeStats, create_controller
from kvserve.structured_output.manager import StructuredOutputManager
from kvserve.worker import KernelBuild, KVCacheLayout, TransferStats, WorkerDiedError, \
    create_worker
from kvserve.worker.worker_base import ModelRunnerOutput
from kvserve.worker.step_profiler import StepTimeStats

logger = init_logger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The engine's state between steps, for metrics (one value, no reaching inside)."""

    scheduler: SchedulerStats
    transfers: TransferStats
    spec_decode: SpecDecodeStats | None = None  # None: speculation off
    step_time: StepTimeStats = StepTimeStats()


class LLMEngine:
    def __init__(self, args: EngineArgs | EngineConfig, model=None) -> None:
        """``model``: weights already loaded for these settings' model (see create_worker)."""
        self.config = config = (args.create_engine_config() if isinstance(args, EngineArgs)
                                else args)
        self.worker = create_worker(config, model)
        self.kv_layout: KVCacheLayout = self.worker.determine_kv_cache_layout()
        self.worker.initialize_kv_cache(self.kv_layout)
        layout = self.kv_layout
        spec = config.speculative
        self.kv = create_kv_manager(
            config.cache, layout.num_blocks, layout.swap_slots, layout.disk_slots,
            engine_kv_groups(config), config.scheduler.max_num_batched_tokens
            + (spec.num_speculative_tokens if spec is not None else 0))
        self.scheduler = Scheduler(config.scheduler, self.kv,
                                   config.lora.max_loras if config.lora is not None else None)
        self.loras = LoRARegistry(config.lora, config.model.arch)
        self.tokenizer = Tokenizer(config.model.tokenizer_path)
        self.pooling_config = read_pooling_config(config.model.model_dir,
                                                  config.model.arch.hidden_size)
        self.outputs = OutputProcessor(self.tokenizer)
        self.eos_token_id, self.extra_stop_ids = stop_token_ids(
            config.model.model_dir, config.model.arch.eos_token_ids, self.tokenizer)
        self._ids = itertools.count()
        self.last_step_stats: SchedulerStats | None = None
        self.last_step_preempted: list[str] = []  # request ids (as added) the step preempted
        self._overlap = config.scheduler.async_scheduling
        self._in_flight: tuple[SchedulerOutput, Future] | None = None  # async scheduling
        self.structured = StructuredOutputManager(
            config.model.model_dir, self.vocab_size,
            [t for t in [self.eos_token_id, *self.extra_stop_ids] if t is not None])
        if config.model.sampling_defaults:
            logger.info("default sampling parameters from %s: %s (a request's own fields "
                        "win; --generation-config vllm drops them)",
                        "the model's generation_config.json"
                        if config.model.generation_config == "auto"
                        else config.model.generation_config, config.model.sampling_defaults)
        self.worker.warm_up()
        self.speculator = create_controller(config, self.worker)
        if config.cache.warmup_prompts:
            self.pin_prompts(config.cache.warmup_prompts)
        self.worker.finish_startup()

    # -- set-up and state ----------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.config.model.arch.vocab_size

    def cache_config_info(self) -> dict[str, object]:
        """The KV cache settings in force (exported as kvserve:cache_config_info)."""
        cache = self.config.cache
        return {"block_size": cache.block_size, "cache_dtype": self.kv_layout.dtype_name,
                "num_kv_blocks": self.kv_layout.num_blocks, "kv_manager": cache.kv_manager,
                "enable_prefix_caching": cache.enable_prefix_caching}

    def kernel_build(self) -> KernelBuild:
        """Whether the worker's native kernels built (``/health`` and the
        ``kernels_compiled`` metric report it)."""
        return self.worker.kernel_build()

    def queue_sizes(self) -> tuple[int, int]:
        """(running, waiting) requests, cheaply (get_stats takes a KV snapshot)."""
        return self.scheduler.num_running, self.scheduler.num_waiting

    def get_stats(self) -> EngineStats:
        spec = self.speculator.stats if self.speculator is not None else None
        return EngineStats(self.scheduler.stats(), self.worker.transfer_stats(), spec,
                           self.worker.step_time_stats())

    def pin_prompts(self, path: str) -> None:
        """Compute the KV of each prompt in ``path`` and pin it in the prefix cache."""
        prompts = read_prompt_file(path)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ids = [self.add_request(f"warmup-{i}", p, params) for i, p in enumerate(prompts)]
        while self.has_unfinished_requests():
            self.step()
        pinned = sum(self.kv.pin_prefix(self.tokenize_prompt(p)[1]) for p in prompts)
        logger.info("warm-up: %d prompts, %d tokens of KV pinned in the prefix cache",
                    len(ids), pinned)

    def settle(self) -> None:
        """Return once start-up's background work is done (the KV pool's pages backed):
        benchmarks call it before timing steps."""
        self.worker.settle()

    def close(self) -> None:
        if self._in_flight is not None:  # its requests are dropped with the engine
            self._in_flight[1].exception()
            self._in_flight = None
        self.worker.close()

    # -- requests ------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    @property
    def stop_ids(self) -> set[int]:
        """The tokens that end a sequence: the model's EOS and its other stop tokens."""
        return {t for t in (self.eos_token_id, *self.extra_stop_ids) if t is not None}

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """Checks the prompt; returns the resolved max_tokens."""
        return validate_prompt(token_ids, params, self.vocab_size, self.max_model_len)

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    background: bool = False, lora_request: LoRARequest | None = None) -> str:
        """``params``: how to generate, or (PoolingParams) how to pool the prompt into an
        embedding; ``background``: a batch line, below every other request (see the
        scheduler); ``lora_request``: the adapter it runs with (added if new)."""
        if lora_request is not None:
            self.add_lora(lora_request)
        if isinstance(params, PoolingParams):
            return self._add_pooling(request_id, prompt, params, arrival_time, priority,
                                     background, lora_request)
        if self.config.model.runner == "pooling":
            raise ValueError("this engine runs the model for embeddings (runner 'pooling'): "
                             "send embedding requests (PoolingParams, /v1/embeddings)")
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self._in_flight is not None:  # its tokens would be taken for the new one's
            running = {s.request_id for s in self._in_flight[0].scheduled}
            if running & {request_id, *(f"{request_id}#{i}" for i in range(params.n))}:
                raise ValueError(f"request id {request_id!r} is still in the running step; "
                                 "use another id, or step once more first")
        text, token_ids = self.tokenize_prompt(prompt)
        max_tokens = self.validate_prompt(token_ids, params)
        grammar = self.structured.compile(params) if params.structured_outputs else None
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = []
        for i in range(params.n):
            child = params if params.n == 1 else params.for_child(i)
            if self.extra_stop_ids and not child.ignore_eos:
                child = dataclasses.replace(child, stop=child.stop_list, stop_token_ids=sorted(
                    set(child.stop_token_ids) | set(self.extra_stop_ids)))
            children.append(Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=token_ids, sampling_params=child,
                eos_token_id=self.eos_token_id, max_tokens=max_tokens, arrival_time=arrival,
                priority=priority, background=background, lora_request=lora_request))
        for child in children:
            self.scheduler.add_request(child)  # children are alike: the first raises if any
            if grammar is not None:
                self.structured.add(child, grammar)
        self.outputs.add(request_id, text, children)
        return request_id

    def _add_pooling(self, request_id: str | None, prompt: PromptType, params: PoolingParams,
                     arrival_time: float | None, priority: int, background: bool,
                     lora_request: LoRARequest | None) -> str:
        """An embedding request: its prompt is computed, its hidden states pooled, nothing
        generated; it goes through the scheduler beside generation requests."""
        if self.config.model.runner == "generate":
            raise ValueError("this engine runs the model for generation (runner 'generate'): "
                             "embeddings are off")
        pooling = self.pooling_config.resolve(params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids, SamplingParams(max_tokens=1))
        req = Request(request_id=request_id, prompt_token_ids=token_ids,
                      sampling_params=SamplingParams(max_tokens=1), eos_token_id=None,
                      max_tokens=0, pooling=pooling, priority=priority, background=background,
                      lora_request=lora_request,
                      arrival_time=arrival_time if arrival_time is not None
                      else time.monotonic())
        self.scheduler.add_request(req)
        self.outputs.add(request_id, text, [req])
        return request_id

    # -- LoRA adapters -----------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter against the base model and serve it; False if it was
        served already (as vLLM's ``add_lora``)."""
        return self.loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Stop serving an adapter: new requests may not name it (those running finish
        with it); its weights leave the worker. False if it was not served."""
        if self.loras.remove(lora_int_id) is None:
            return False
        self.worker.remove_lora(lora_int_id)
        return True

    def list_loras(self) -> list[LoRARequest]:
        return list(self.loras.by_id.values())

    def abort_request(self, request_ids: str | list[str]) -> None:
        for parent in [request_ids] if isinstance(request_ids, str) else request_ids:
            children = self.outputs.child_ids(parent)
            for child in children:
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
            self.structured.remove(children)
            self._forget_drafts(children)
            self.outputs.remove(parent)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (as vLLM's ``reset_prefix_cache``): the next
        requests compute their prompts in full. Only while no request runs; returns
        whether it was done."""
        if self.has_unfinished_requests():
            return False
        self.kv.reset_prefix_cache()
        return True

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step; ``last_step_stats`` then holds the scheduler's state as that step
        was scheduled (None when it had nothing to run).

        With async scheduling the step whose outputs this returns was started by the
        call before (or by this one, when none ran); the next starts as soon as its
        tokens are applied, and its text and outputs are made while that one computes.
        A stop string is found one step late there: the request is finished then, and
        the token the next step computed for it is dropped."""
        if self._overlap:
            return self._step_overlapped()
        sched = self._schedule()
        self._scheduled(sched)
        try:
            step = self.worker.execute_model(sched)
        except Exception as e:  # noqa: BLE001 - _failed decides
            return self._failed(sched, e)
        return self._emit(self._apply(sched, step), step)

    def _step_overlapped(self) -> list[RequestOutput]:
        if self._in_flight is None:
            sched = self._schedule()
            self._in_flight = (sched, self.worker.submit(sched))
        sched, future = self._in_flight
        self._in_flight = None
        self._scheduled(sched)
        try:
            step = future.result()
        except Exception as e:  # noqa: BLE001 - _failed decides
            return self._failed(sched, e)
        progressed = self._apply(sched, step)
        try:
            if self.scheduler.has_unfinished():  # start the next step before the outputs
                nxt = self._schedule()
                self._in_flight = (nxt, self.worker.submit(nxt))
        finally:  # the tokens applied reach the text even if the next step did not start
            outputs = self._emit(progressed, step)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        if self.speculator is not None:
            drafts = self.speculator.propose(self.scheduler.running)
            if self.structured.has_any():
                drafts = self.structured.cut_drafts(drafts)
            self.scheduler.set_drafts(drafts)
        sched = self.scheduler.schedule()
        if self.structured.has_any():
            sched = dataclasses.replace(
                sched, token_masks=self.structured.masks_in_background(sched))
        return sched

    def _scheduled(self, sched: SchedulerOutput) -> None:
        self.last_step_stats = sched.stats
        self.last_step_preempted = list(dict.fromkeys(
            self.outputs.parent_of.get(c, c) for c in sched.preempted))

    def _failed(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        if isinstance(error, WorkerDiedError):  # no step can run again: the engine stops
            logger.error("the worker died; failing every request", exc_info=error)
            self._fail(list(self.scheduler.requests))
            raise error
        # a failing step fails its requests, not the engine
        logger.error("model step failed; failing its %d requests", len(sched.scheduled),
                     exc_info=error)
        self.kv.reset_prefix_cache()  # blocks registered for this step were never written
        return self._fail([s.request_id for s in sched.scheduled])

    def _apply(self, sched: SchedulerOutput, step: ModelRunnerOutput
               ) -> list[tuple[Request, int]]:
        """The step's tokens into the scheduler (which finishes requests that stop on a
        token) and the grammars; returns what progressed."""
        results = step.sampled
        if step.prompt_logprobs:
            self.outputs.add_prompt_logprobs(step.prompt_logprobs)
        if step.pooled:
            self.outputs.add_pooled(step.pooled)
        if self.speculator is not None:
            self.speculator.record(sched, results)
        progressed = self.scheduler.update(
            sched, {rid: [r.token_id for r in rs] for rid, rs in results.items()})
        if self.structured.has_any():
            self.structured.advance(progressed)
        return progressed

    def _emit(self, progressed: list[tuple[Request, int]], step: ModelRunnerOutput
              ) -> list[RequestOutput]:
        """Text, stop strings and the outputs of what progressed."""
        self.scheduler.finish_on_stop_strings(
            self.outputs.process_tokens(progressed, step.sampled))
        finished = [r.request_id for r, _ in progressed if r.is_finished]
        self.structured.remove(finished)
        self._forget_drafts(finished)
        parents = dict.fromkeys(self.outputs.parent_of[r.request_id] for r, _ in progressed)
        return [self.outputs.make_output(p) for p in parents]

    def _forget_drafts(self, request_ids: list[str]) -> None:
        """A finished request's proposer state (a draft model's KV) goes with it."""
        if self.speculator is not None and request_ids:
            self.speculator.forget(request_ids)

    def _fail(self, child_ids: list[str]) -> list[RequestOutput]:
        parents = dict.fromkeys(self.outputs.parent_of[c] for c in child_ids
                                if c in self.outputs.parent_of)
        outs = []
        for parent in parents:
            children = self.outputs.child_ids(parent)
            for child in children:
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ERROR)
            self.structured.remove(children)
            self._forget_drafts(children)
            out = self.outputs.make_output(parent)
            out.error = "internal error while running the model"
            outs.append(out)
        return outs

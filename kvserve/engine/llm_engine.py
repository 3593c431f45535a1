"""LLMEngine: the synchronous step loop that ties scheduler, KV manager and runner.

add_request -> step() ... -> RequestOutputs. One step schedules a flat batch,
runs the model on it, advances the scheduler with the sampled tokens and turns them
into text. The engine is not thread-safe; the async engine drives it from one thread.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from pathlib import Path

import torch

from kvserve.config import EngineArgs, parse_size
from kvserve.core.kv import create_kv_manager
from kvserve.core.scheduler import Scheduler
from kvserve.engine.output_processor import OutputProcessor
from kvserve.kernels import load_kernels
from kvserve.logger import init_logger
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model, resolve_dtype
from kvserve.model.tokenizer import Tokenizer
from kvserve.outputs import RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.worker.model_runner import ModelRunner, kv_bytes_per_block
from kvserve.worker.platform import available_memory_bytes, cpus_to_bind, \
    freeze_startup_objects, keep_freed_memory, physical_cores

logger = init_logger(__name__)

PromptType = str | list[int] | dict
_DEFAULT_KV_SHARE = 0.4  # of available RAM: the rest is headroom for weights and activations
_DEFAULT_KV_CAP = 4 * 2**30  # as vLLM's CPU backend: more is rarely used, and zeroing costs


def read_prompt_file(path: str) -> list[str | dict]:
    """Prompts, one per line: plain text, or JSON objects with 'prompt' or
    'prompt_token_ids' (JSONL). Blank lines are skipped."""
    prompts: list[str | dict] = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            prompts.append(json.loads(line))
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise ValueError(f"warm-up prompt file {path} holds no prompt")
    return prompts


def resolve_model_dir(model: str | None) -> Path:
    if model is None:
        from kvserve.models import default_model_dir
        model = default_model_dir()
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {model!r} does not exist (kvserve loads "
                                "local directories in Hugging Face layout; no hub downloads)")
    return path


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model_dir = resolve_model_dir(args.model)
        torch.set_num_threads(args.num_threads or physical_cores())
        self.bound_cpus = self._bind_compute_threads()
        keep_freed_memory()
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.max_model_len = self._max_model_len()
        self.dtype = resolve_dtype(args.dtype, self.model_config)
        self.kv_dtype = (self.dtype if args.kv_cache_dtype == "auto"
                         else getattr(torch, args.kv_cache_dtype))
        self.kv_dtype_name = str(self.kv_dtype).removeprefix("torch.")
        start = time.perf_counter()
        model = load_model(self.model_dir, self.model_config, self.dtype, args.quantization)
        self.num_kv_blocks = self._num_kv_blocks()
        swap_slots, disk_slots = self._tier_slots()
        self.kv = create_kv_manager(args, self.num_kv_blocks, swap_slots=swap_slots,
                                    disk_slots=disk_slots)
        self.scheduler = Scheduler(args, self.kv)
        disk_path = (Path(args.kv_offload_dir) / f"kvserve-kv-{os.getpid()}.bin"
                     if disk_slots else None)
        self.runner = ModelRunner(model, self.model_config, self.num_kv_blocks,
                                  args.block_size, self.kv_dtype, args.seed, swap_slots,
                                  disk_slots, disk_path, args.attention_backend == "auto")
        self.runner.warm_up(min(args.max_num_batched_tokens, self.max_model_len - 1))
        self.linear_min_rows, pass_times = self.runner.pad_small_gemms(args.linear_min_rows)
        if pass_times:
            rows = self.linear_min_rows
            logger.info("linear layers, one pass at 1-%d rows (ms): %s; %s", len(pass_times),
                        " ".join(f"{1000 * t:.2f}" for t in pass_times.values()),
                        f"GEMMs of fewer rows run padded to {rows}" if rows > 1
                        else "no padding (no row count clearly faster)")
        self._warm_gemm_kernels()
        self.outputs = OutputProcessor(self.tokenizer)
        self.eos_token_id, self.extra_stop_ids = self._eos_ids()
        self._ids = itertools.count()
        logger.info("loaded %s (%s, %s, %d threads) in %.1fs; max_model_len %d",
                    self.model_dir, self.model_config.architecture, self.dtype,
                    torch.get_num_threads(), time.perf_counter() - start, self.max_model_len)
        if args.warmup_prompts:
            self.warm_up(args.warmup_prompts)
        freeze_startup_objects()

    # -- set-up ----------------------------------------------------------------------------

    def cache_config_info(self) -> dict[str, object]:
        """The KV cache settings in force (exported as kvserve:cache_config_info)."""
        return {"block_size": self.args.block_size, "cache_dtype": self.kv_dtype_name,
                "num_kv_blocks": self.num_kv_blocks, "kv_manager": self.args.kv_manager,
                "enable_prefix_caching": self.args.enable_prefix_caching}

    def _bind_compute_threads(self) -> list[int] | None:
        """Bind torch's compute threads one to a CPU (``omp_threads_bind``), as vLLM's CPU
        worker does: unbound, the scheduler moves them between cores and stacks them with
        other threads. Called from the thread that will run the model (its OpenMP team is
        the one bound). Returns the CPUs, or None when not bound."""
        threads = torch.get_num_threads()
        cpus = cpus_to_bind(self.args.omp_threads_bind, threads)
        if cpus is None:
            return None
        kernels = load_kernels()
        if not kernels.available:
            logger.info("compute threads not bound: no native kernels (%s)", kernels.reason)
            return None
        failed = kernels.bind_threads(cpus)
        if failed:
            raise RuntimeError(f"could not bind {failed} of {threads} compute threads to CPUs "
                               f"{cpus}")
        logger.info("compute threads bound to CPUs %s", ",".join(map(str, cpus)))
        return cpus

    def _warm_gemm_kernels(self) -> None:
        rows = self.args.gemm_warmup_rows
        rows = self.args.max_num_seqs if rows is None else rows
        if not rows:
            return
        start = time.perf_counter()
        shapes, warmed = self.runner.warm_gemm_kernels(rows)
        if shapes:
            capped = f" (of {rows}: the kernel caches' room)" if warmed < rows else ""
            logger.info("GEMM kernels generated for %d shapes x 1-%d rows%s in %.1fs", shapes,
                        warmed, capped, time.perf_counter() - start)

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.args.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's "
                             f"max_position_embeddings {limit}")
        return wanted

    def _num_kv_blocks(self) -> int:
        args = self.args
        per_block = kv_bytes_per_block(self.model_config, args.block_size, self.kv_dtype)
        if args.num_kv_blocks is not None:
            num = args.num_kv_blocks
            source = "num_kv_blocks"
        elif args.kv_cache_memory is not None:
            num = parse_size(args.kv_cache_memory) // per_block
            source = f"kv_cache_memory={args.kv_cache_memory}"
            if num < 1:
                raise ValueError(f"kv_cache_memory {args.kv_cache_memory} is smaller than one KV "
                                 f"block ({per_block} bytes)")
        else:
            share = int(min(available_memory_bytes() * _DEFAULT_KV_SHARE, _DEFAULT_KV_CAP))
            useful = args.max_num_seqs * -(-self.max_model_len // args.block_size)
            num = max(1, min(share // per_block, useful))
            source = (f"default: min({_DEFAULT_KV_SHARE:.0%} of available RAM, "
                      f"{_DEFAULT_KV_CAP / 2**30:g} GiB, max_num_seqs x max_model_len)")
        logger.info("KV cache: %d blocks x %d tokens = %.1f MiB of %s (%s)", num,
                    args.block_size, num * per_block / 2**20, self.kv_dtype_name, source)
        return num

    def _tier_slots(self) -> tuple[int, int]:
        args = self.args
        per_block = kv_bytes_per_block(self.model_config, args.block_size, self.kv_dtype)
        swap = int(args.swap_space * 2**30) // per_block if args.preemption_mode == "swap" else 0
        disk = parse_size(args.kv_offload_size) // per_block if args.kv_offload_dir else 0
        if args.preemption_mode == "swap" and swap < 1:
            raise ValueError(f"swap_space {args.swap_space} GiB holds no KV block "
                             f"({per_block} bytes); raise it or use preemption_mode recompute")
        if args.kv_offload_dir and disk < 1:
            raise ValueError(f"kv_offload_size {args.kv_offload_size} holds no KV block "
                             f"({per_block} bytes)")
        for name, slots in (("swap space", swap), ("disk tier", disk)):
            if slots:
                logger.info("%s: %d blocks (%.1f MiB)", name, slots, slots * per_block / 2**20)
        return swap, disk

    def warm_up(self, path: str) -> None:
        """Compute the KV of each prompt in ``path`` and pin it in the prefix cache."""
        prompts = read_prompt_file(path)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ids = [self.add_request(f"warmup-{i}", p, params) for i, p in enumerate(prompts)]
        while self.has_unfinished_requests():
            self.step()
        pinned = sum(self.kv.pin_prefix(self.tokenize_prompt(p)[1]) for p in prompts)
        logger.info("warm-up: %d prompts, %d tokens of KV pinned in the prefix cache",
                    len(ids), pinned)

    def _eos_ids(self) -> tuple[int | None, list[int]]:
        ids = list(self.model_config.eos_token_ids)
        gen_path = self.model_dir / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
        primary = self.tokenizer.eos_token_id
        if primary is None and ids:
            primary = ids[0]
        return primary, sorted({i for i in ids if i != primary})

    # -- requests ------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, "
                         f"got {type(prompt).__name__}")

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """Checks the prompt; returns the resolved max_tokens."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens but max_model_len is {self.max_model_len}: "
                             "it must be shorter to leave room for at least one new token")
        room = self.max_model_len - n
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"prompt has {n} tokens and max_tokens is {params.max_tokens}: together "
                f"{n + params.max_tokens} exceed max_model_len {self.max_model_len}")
        return params.max_tokens

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        max_tokens = self.validate_prompt(token_ids, params)
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
                priority=priority))
        for child in children:
            self.scheduler.add_request(child)  # children are alike: the first raises if any
        self.outputs.add(request_id, text, children)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for parent in [request_ids] if isinstance(request_ids, str) else request_ids:
            for child in self.outputs.child_ids(parent):
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
            self.outputs.remove(parent)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

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
        sched = self.scheduler.schedule()
        try:
            results = self.runner.execute(sched)
        except Exception:  # a failing step fails its requests, not the engine
            logger.exception("model step failed; failing its %d requests", len(sched.scheduled))
            self.kv.reset_prefix_cache()  # blocks registered for this step were never written
            return self._fail([s.request_id for s in sched.scheduled])
        progressed = self.scheduler.update(sched, {k: r.token_id for k, r in results.items()})
        for req in self.outputs.process_tokens(progressed, results):
            if req.is_finished:
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        parents = dict.fromkeys(self.outputs.parent_of[r.request_id] for r in progressed)
        return [self.outputs.make_output(p) for p in parents]

    def _fail(self, child_ids: list[str]) -> list[RequestOutput]:
        parents = dict.fromkeys(self.outputs.parent_of[c] for c in child_ids
                                if c in self.outputs.parent_of)
        outs = []
        for parent in parents:
            for child in self.outputs.child_ids(parent):
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ERROR)
            out = self.outputs.make_output(parent)
            out.error = "internal error while running the model"
            outs.append(out)
        return outs

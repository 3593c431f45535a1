"""EngineArgs: every engine setting in one flat dataclass, as the user spells it.

The CLI flags are generated from these fields (``max_num_seqs`` -> ``--max-num-seqs``),
so the Python and command-line spellings never drift apart. ``create_engine_config()``
turns them into an :class:`~kvserve.config.engine.EngineConfig` of validated parts; the
rules live in those parts, and building EngineArgs already runs the ones that need no
checkpoint, so a bad setting fails where it is written.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields

from kvserve.config.cache import KV_CACHE_DTYPES, CacheConfig
from kvserve.config.engine import EngineConfig
from kvserve.config.model import DTYPES, QUANTIZATION_METHODS, ModelConfig
from kvserve.config.parallel import ParallelConfig
from kvserve.config.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES, SchedulerConfig
from kvserve.config.speculative import SpeculativeConfig
from kvserve.config.worker import ATTENTION_BACKENDS, WorkerConfig


def _help(text: str, **extra) -> dict:
    return {"help": text, **extra}


@dataclass
class EngineArgs:
    """Engine settings (vLLM's names where the concept is the same)."""

    model: str | None = field(default=None, metadata=_help(
        "model directory in Hugging Face layout (default: the embedded model)"))
    dtype: str = field(default="auto", metadata=_help(
        "compute dtype; auto picks float32 on CPUs without bf16 hardware", choices=DTYPES))
    seed: int = field(default=0, metadata=_help("seed of the global sampling generator"))
    kv_cache_dtype: str = field(default="auto", metadata=_help(
        "element type of the KV cache; auto: the compute dtype. float16 / bfloat16 with "
        "float32 compute halve the KV memory and the bytes decode attention reads (the "
        "attention math stays float32); not bit-exact with a float32 cache",
        choices=KV_CACHE_DTYPES))
    max_model_len: int | None = field(default=None, metadata=_help(
        "longest sequence (prompt + output); default: the model's max_position_embeddings"))
    block_size: int = field(default=16, metadata=_help("token slots per KV block"))
    kv_cache_memory: int | str | None = field(default=None, metadata=_help(
        "KV cache size, bytes or e.g. '2GiB' (default: a share of free RAM)"))
    num_kv_blocks: int | None = field(default=None, metadata=_help(
        "number of KV blocks; overrides --kv-cache-memory"))
    max_num_seqs: int = field(default=128, metadata=_help("most requests running at once"))
    # 2048, as vLLM's CPU server: a prompt up to that length is never split across steps
    # (a split leaves its last tokens to share a step with the next prompt's prefill,
    # which delays the first token; serving tail TTFT was lower at 2048); offline
    # throughput did not depend on it.
    max_num_batched_tokens: int = field(default=2048, metadata=_help(
        "token budget of one engine step (prefill chunks + decodes)"))
    prefill_join_tokens: int = field(default=0, metadata=_help(
        "continuous batching: a waiting prompt joins a step only while the step's "
        "prefill tokens are fewer than this (0, the default: up to the budget); a later "
        "prompt then waits a step instead of delaying an earlier one's first token, at "
        "the cost of more steps that stall the decodes"))
    kv_manager: str = field(default="paged", metadata=_help(
        "KV memory design", registry="kv_manager"))
    batching: str = field(default="continuous", metadata=_help(
        "batching policy", registry="batching"))
    scheduling_policy: str = field(default="fcfs", metadata=_help(
        "order of admission for continuous batching; priority: lower value first, "
        "preempting lower-priority running requests, ties first come first served",
        choices=SCHEDULING_POLICIES))
    max_batch_size: int = field(default=16, metadata=_help(
        "requests per batch of static batching and per released length-bucket batch"))
    bucket_window_s: float = field(default=0.1, metadata=_help(
        "length-bucket batching: release a bucket once its oldest request has waited "
        "this long, even if it holds fewer than max_batch_size requests"))
    memory_pool_ratio: float = field(default=1.0, metadata=_help(
        "buddy kv_manager: share of the KV blocks pre-allocated as the buddy memory pool"))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "reuse the KV of full blocks shared with earlier prompts (paged kv_manager)"))
    background_step_tokens: int = field(default=2, metadata=_help(
        "while foreground requests are there (and for 5 s after), background ones (batch "
        "API lines) compute at most this many tokens a step, so they never stretch a "
        "realtime decode step; 0: they wait"))
    async_scheduling: bool = field(default=False, metadata=_help(
        "as vLLM's: schedule and start the next step as soon as a step's tokens are in, "
        "and turn the tokens into text and outputs while the model computes it (the model "
        "runs on a thread of its own); not with speculative decoding"))
    preemption_mode: str = field(default="recompute", metadata=_help(
        "what preemption does with a victim's KV: recompute it later, or swap it to host "
        "memory and back (paged kv_manager)", choices=PREEMPTION_MODES))
    swap_space: float = field(default=4.0, metadata=_help(
        "GiB of host memory for swapped-out KV blocks (preemption_mode swap)"))
    kv_offload_dir: str | None = field(default=None, metadata=_help(
        "directory of a file that keeps prefix-cache blocks evicted from memory (disk tier)"))
    kv_offload_size: int | str = field(default="4GiB", metadata=_help(
        "size of the disk tier file, bytes or e.g. '8GiB'"))
    warmup_prompts: str | None = field(default=None, metadata=_help(
        "file of prompts (one per line, or JSONL with 'prompt') whose KV is computed at "
        "start and pinned in the prefix cache"))
    quantization: str | None = field(default=None, metadata=_help(
        "int8: linear layers run as int8 x int8 -> int32 with per-channel weight scales and "
        "per-token activation scales (faster GEMMs on CPUs with VNNI); not bit-exact with "
        "the float model", choices=QUANTIZATION_METHODS))
    attention_backend: str = field(default="auto", metadata=_help(
        "auto (native attention and elementwise kernels when they build and the compute "
        "dtype is float32; oneDNN packed linear layers) or torch (gather + SDPA, F.linear)",
        choices=ATTENTION_BACKENDS))
    linear_min_rows: int | None = field(default=None, metadata=_help(
        "packed linear layers run GEMMs of fewer rows padded to this many (the real rows "
        "computed as in a GEMM of that size); default: measured at start among 1-8 rows "
        "on the model's own layers (some CPUs stream the weights of a 1-row GEMM slower "
        "than of a 6-row one); 1: no padding"))
    panel_gemm_max_rows: int | None = field(default=None, metadata=_help(
        "float32 linear layers of more rows than the few-row paths take run on the native "
        "panel GEMM up to this many rows and on oneDNN above; default: measured at start "
        "(decode steps of 16-128 requests on each, and lone GEMMs of a prompt step's rows); "
        "0: oneDNN only"))
    gemm_warmup_rows: int | None = field(default=None, metadata=_help(
        "at start, run each linear layer shape at every row count 1..N so that oneDNN has "
        "generated its GEMM kernels before the first steps need them (the CPU counterpart "
        "of capturing a CUDA graph per batch size); default: max_num_seqs; 0: off"))
    num_threads: int | None = field(default=None, metadata=_help(
        "torch threads (default: physical cores)"))
    omp_threads_bind: str = field(default="auto", metadata=_help(
        "CPUs the compute threads are bound to, one each, as vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND: auto (one CPU per physical core), nobind, or a list "
        "such as 0-3 or 0,2; with tensor parallelism one list per rank split by '|', "
        "e.g. 0|1 (auto: each rank its own cores)"))
    step_profile_interval: int = field(default=16, metadata=_help(
        "time one step in this many by part (linear layers, attention, other) for the "
        "metrics and the dashboard; the other steps run unhooked; 0: off"))
    enforce_eager: bool = field(default=False, metadata=_help(
        "run every step layer by layer from Python: no captured steps (by default a "
        "Llama-family float32 model runs steps of 1-8 rows, where measured faster at "
        "start, as one native call)"))
    huge_pages: bool = field(default=True, metadata=_help(
        "copy the weights, and allocate the KV pools, on transparent huge pages where the "
        "kernel offers them (THP 'always' or 'madvise'): fewer TLB misses while a step "
        "streams them"))

    tensor_parallel_size: int = field(default=1, metadata=_help(
        "ranks that split the model's heads, MLP and vocabulary between them, one "
        "process each, on torch.distributed's gloo over loopback"))

    speculative_config: dict | str | None = field(default=None, metadata=_help(
        "speculative decoding, as vLLM's (JSON on the command line), e.g. "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; drafts are verified "
        "exactly and used only where they pay"))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every rule that needs no checkpoint; the model directory is read later, by
        :meth:`create_engine_config`."""
        ModelConfig.check(self.dtype, self.max_model_len, self.quantization)
        self.create_scheduler_config()
        self.create_cache_config()
        self.create_worker_config()
        SpeculativeConfig.from_value(self.speculative_config)
        ParallelConfig(self.tensor_parallel_size)

    # -- the parts ---------------------------------------------------------------------

    def create_scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            prefill_join_tokens=self.prefill_join_tokens, batching=self.batching,
            scheduling_policy=self.scheduling_policy, max_batch_size=self.max_batch_size,
            bucket_window_s=self.bucket_window_s, preemption_mode=self.preemption_mode,
            background_step_tokens=self.background_step_tokens,
            async_scheduling=self.async_scheduling)

    def create_cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_memory=self.kv_cache_memory, num_kv_blocks=self.num_kv_blocks,
            kv_manager=self.kv_manager, memory_pool_ratio=self.memory_pool_ratio,
            enable_prefix_caching=self.enable_prefix_caching, swap_space=self.swap_space,
            kv_offload_dir=self.kv_offload_dir, kv_offload_size=self.kv_offload_size,
            warmup_prompts=self.warmup_prompts, swap_enabled=self.preemption_mode == "swap")

    def create_worker_config(self) -> WorkerConfig:
        warmup_rows = self.max_num_seqs if self.gemm_warmup_rows is None else self.gemm_warmup_rows
        return WorkerConfig(
            attention_backend=self.attention_backend, linear_min_rows=self.linear_min_rows,
            panel_gemm_max_rows=self.panel_gemm_max_rows, gemm_warmup_rows=warmup_rows,
            num_threads=self.num_threads,
            omp_threads_bind=self.omp_threads_bind,
            step_profile_interval=self.step_profile_interval,
            enforce_eager=self.enforce_eager, huge_pages=self.huge_pages)

    def create_engine_config(self) -> EngineConfig:
        """The validated parts; reads the model directory's config.json."""
        model = ModelConfig.create(self.model, self.dtype, self.max_model_len,
                                   self.quantization, self.seed)
        return EngineConfig(model=model, cache=self.create_cache_config(),
                            scheduler=self.create_scheduler_config(),
                            worker=self.create_worker_config(),
                            speculative=SpeculativeConfig.from_value(self.speculative_config),
                            parallel=ParallelConfig(self.tensor_parallel_size))

    # -- the command line ----------------------------------------------------------------

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """One ``--flag`` per field; defaults stay None so only given flags are passed."""
        for f in fields(cls):
            if f.name in skip or not f.metadata:
                continue
            kwargs = dict(f.metadata)
            default = f.default
            flag = "--" + f.name.replace("_", "-")
            text = f"{kwargs.pop('help')} (default: {default})"
            if isinstance(default, bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                    help=text)
                continue
            if "registry" in kwargs:
                kwargs["choices"] = _registry(kwargs.pop("registry")).names()
            parser.add_argument(flag, type=_cli_type(f), default=None, help=text, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> EngineArgs:
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if getattr(args, f.name, None) is not None}
        given.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**given)

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)


def _registry(setting: str):
    """The registry of a pluggable family, by the setting that names its members."""
    if setting == "kv_manager":
        from kvserve.core.kv import KV_MANAGERS
        return KV_MANAGERS
    from kvserve.core.batching import BATCHING_POLICIES
    return BATCHING_POLICIES


def _cli_type(f: dataclasses.Field):
    if f.name in ("kv_cache_memory", "kv_offload_size"):
        return str  # sizes with units
    annotation = str(f.type)
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str

"""EngineArgs: every engine setting in one flat dataclass, as the user spells it.

The CLI flags are generated from these fields (``max_num_seqs`` -> ``--max-num-seqs``),
so the Python and command-line spellings never drift apart. Each setting that a config
part holds takes its default from that part (:mod:`kvserve.config`), and each part is
built from the fields of its own names, so a default is written once and a setting
reaches its part without being copied by hand. ``create_engine_config()`` turns the
settings into an :class:`~kvserve.config.engine.EngineConfig`; the rules live in the
parts, the names of pluggable members are checked against the registries of the
layers that own them (``core``, ``spec_decode``, ``model``), and building EngineArgs
already runs every rule that needs no checkpoint, so a bad setting fails where it is
written.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from kvserve.config.cache import KV_CACHE_DTYPES, CacheConfig
from kvserve.config.engine import EngineConfig
from kvserve.config.lora import LoRAConfig
from kvserve.config.model import DTYPES, GGUF_ACTIVATIONS, ModelConfig
from kvserve.config.parallel import ParallelConfig
from kvserve.config.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES, SchedulerConfig
from kvserve.config.speculative import SpeculativeConfig
from kvserve.config.worker import ATTENTION_BACKENDS, DEVICES, WorkerConfig
from kvserve.core.batching import BATCHING_POLICIES
from kvserve.core.kv import KV_MANAGERS
from kvserve.model.model_config import check_model_settings, create_model_config
from kvserve.model.quantization import QUANTIZATION_METHODS
from kvserve.model.tensor_parallel import check_shardable
from kvserve.spec_decode import PROPOSERS
from kvserve.spec_decode.draft_model import check_draft_model
from kvserve.worker.device import resolve_device

Part = TypeVar("Part")


def _setting(default: Any, text: str, **extra: Any) -> Any:
    """A field with its default and its flag's help (and argparse keywords, or the
    ``registry`` its names come from)."""
    return field(default=default, metadata={"help": text, **extra})


@dataclass
class EngineArgs:
    """Engine settings (vLLM's names where the concept is the same)."""

    model: str | None = _setting(
        None, "model directory in Hugging Face layout (default: the embedded model)")
    tokenizer: str | None = _setting(
        None, "a directory with the tokenizer to use (tokenizer.json, tokenizer_config.json) "
        "instead of the model's own, as vLLM's --tokenizer (a GGUF file's is converted from "
        "its metadata)")
    dtype: str = _setting("auto",
        "compute dtype; auto picks float32 on CPUs without bf16 hardware", choices=DTYPES)
    seed: int = _setting(ModelConfig.seed, "seed of the global sampling generator")
    kv_cache_dtype: str = _setting(CacheConfig.kv_cache_dtype,
        "element type of the KV cache; auto: the compute dtype. float16 / bfloat16 with "
        "float32 compute halve the KV memory and the bytes decode attention reads (the "
        "attention math stays float32); not bit-exact with a float32 cache",
        choices=KV_CACHE_DTYPES)
    max_model_len: int | None = _setting(None,
        "longest sequence (prompt + output); default: the model's max_position_embeddings")
    block_size: int = _setting(CacheConfig.block_size, "token slots per KV block")
    kv_cache_memory: int | str | None = _setting(CacheConfig.kv_cache_memory,
        "KV cache size, bytes or e.g. '2GiB' (default: a share of free RAM)")
    num_kv_blocks: int | None = _setting(CacheConfig.num_kv_blocks,
        "number of KV blocks; overrides --kv-cache-memory")
    max_num_seqs: int = _setting(SchedulerConfig.max_num_seqs, "most requests running at once")
    # 2048, as vLLM's CPU server: a prompt up to that length is never split across steps
    # (a split leaves its last tokens to share a step with the next prompt's prefill,
    # which delays the first token; serving tail TTFT was lower at 2048); offline
    # throughput did not depend on it.
    max_num_batched_tokens: int = _setting(SchedulerConfig.max_num_batched_tokens,
        "token budget of one engine step (prefill chunks + decodes)")
    prefill_join_tokens: int = _setting(SchedulerConfig.prefill_join_tokens,
        "continuous batching: a waiting prompt joins a step only while the step's "
        "prefill tokens are fewer than this (0, the default: up to the budget); a later "
        "prompt then waits a step instead of delaying an earlier one's first token, at "
        "the cost of more steps that stall the decodes")
    kv_manager: str = _setting(CacheConfig.kv_manager, "KV memory design",
                               registry=KV_MANAGERS)
    batching: str = _setting(SchedulerConfig.batching, "batching policy",
                             registry=BATCHING_POLICIES)
    scheduling_policy: str = _setting(SchedulerConfig.scheduling_policy,
        "order of admission for continuous batching; priority: lower value first, "
        "preempting lower-priority running requests, ties first come first served",
        choices=SCHEDULING_POLICIES)
    max_batch_size: int = _setting(SchedulerConfig.max_batch_size,
        "requests per batch of static batching and per released length-bucket batch")
    bucket_window_s: float = _setting(SchedulerConfig.bucket_window_s,
        "length-bucket batching: release a bucket once its oldest request has waited "
        "this long, even if it holds fewer than max_batch_size requests")
    memory_pool_ratio: float = _setting(CacheConfig.memory_pool_ratio,
        "buddy kv_manager: share of the KV blocks pre-allocated as the buddy memory pool")
    enable_prefix_caching: bool = _setting(CacheConfig.enable_prefix_caching,
        "reuse the KV of full blocks shared with earlier prompts (paged kv_manager)")
    disable_hybrid_kv_cache_manager: bool = _setting(
        CacheConfig.disable_hybrid_kv_cache_manager,
        "as vLLM's: keep every layer's KV for the whole sequence; by default a model "
        "mixing sliding-window and full layers (Gemma 2, 3) keeps a block table per layer "
        "group, and windowed layers give back the blocks their window no longer reads "
        "(paged kv_manager)")
    background_step_tokens: int = _setting(SchedulerConfig.background_step_tokens,
        "while foreground requests are there (and for 5 s after), background ones (batch "
        "API lines) compute at most this many tokens a step, so they never stretch a "
        "realtime decode step; 0: they wait")
    async_scheduling: bool = _setting(SchedulerConfig.async_scheduling,
        "as vLLM's: schedule and start the next step as soon as a step's tokens are in, "
        "and turn the tokens into text and outputs while the model computes it (the model "
        "runs on a thread of its own); not with speculative decoding")
    preemption_mode: str = _setting(SchedulerConfig.preemption_mode,
        "what preemption does with a victim's KV: recompute it later, or swap it to host "
        "memory and back (paged kv_manager)", choices=PREEMPTION_MODES)
    swap_space: float = _setting(CacheConfig.swap_space,
        "GiB of host memory for swapped-out KV blocks (preemption_mode swap)")
    kv_offload_dir: str | None = _setting(CacheConfig.kv_offload_dir,
        "directory of a file that keeps prefix-cache blocks evicted from memory (disk tier)")
    kv_offload_size: int | str = _setting(CacheConfig.kv_offload_size,
        "size of the disk tier file, bytes or e.g. '8GiB'")
    warmup_prompts: str | None = _setting(CacheConfig.warmup_prompts,
        "file of prompts (one per line, or JSONL with 'prompt') whose KV is computed at "
        "start and pinned in the prefix cache")
    runner: str = _setting(
        "auto", "as vLLM's: generate (completions and chat), pooling (embeddings only), or "
        "auto: both, embedding requests scheduled beside generation ones",
        choices=("auto", "generate", "pooling"))
    attention_window: int | None = _setting(
        None, "StreamingLLM on a model without a window of its own: each token attends to the "
        "last N tokens (and the attention_sinks first ones), so the model serves sequences "
        "past its trained length (max_model_len may then exceed it)")
    attention_sinks: int = _setting(
        0, "with attention_window: the first N tokens stay visible to every token, as if "
        "just before the window (StreamingLLM's attention sinks; torch attention path)")
    generation_config: str = _setting(ModelConfig.generation_config,
        "where sampling defaults come from, as vLLM's: auto (the model's "
        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens, where it differs from transformers' defaults), vllm (none: the "
        "engine's own), or a directory holding a generation_config.json; a request's own "
        "fields always win")
    quantization: str | None = _setting(ModelConfig.quantization,
        "int8: linear layers run as int8 x int8 -> int32 with per-channel weight scales and "
        "per-token activation scales (faster GEMMs on CPUs with VNNI); not bit-exact with "
        "the float model", choices=QUANTIZATION_METHODS)
    gguf_activations: str = _setting(ModelConfig.gguf_activations,
        "a GGUF file's Q8_0 and K-format layers, decode steps and prompt chunks: int8 "
        "rounds the activations to int8 (per 32 values against Q8_0, per 256 against the "
        "K formats) and sums integer products, as llama.cpp does (faster); float "
        "multiplies the decoded weights by the activations as they are (the sums of "
        "dequantize-then-multiply)", choices=GGUF_ACTIVATIONS)
    attention_backend: str = _setting(WorkerConfig.attention_backend,
        "auto (native attention and elementwise kernels when they build and the compute "
        "dtype is float32; oneDNN packed linear layers) or torch (gather + SDPA, F.linear)",
        choices=ATTENTION_BACKENDS)
    linear_min_rows: int | None = _setting(WorkerConfig.linear_min_rows,
        "packed linear layers run GEMMs of fewer rows padded to this many (the real rows "
        "computed as in a GEMM of that size); default: measured at start among 1-8 rows "
        "on the model's own layers (some CPUs stream the weights of a 1-row GEMM slower "
        "than of a 6-row one); 1: no padding")
    panel_gemm_max_rows: int | None = _setting(WorkerConfig.panel_gemm_max_rows,
        "float32 linear layers of more rows than the few-row paths take run on the native "
        "panel GEMM up to this many rows and on oneDNN above; default: measured at start "
        "(decode steps of 16-128 requests on each, and lone GEMMs of a prompt step's rows); "
        "0: oneDNN only")
    gemm_warmup_rows: int | None = _setting(WorkerConfig.gemm_warmup_rows,
        "at start, run each linear layer shape at every row count 1..N so that oneDNN has "
        "generated its GEMM kernels before the first steps need them (the CPU counterpart "
        "of capturing a CUDA graph per batch size); default: max_num_seqs; 0: off")
    num_threads: int | None = _setting(WorkerConfig.num_threads,
        "torch threads (default: physical cores)")
    omp_threads_bind: str = _setting(WorkerConfig.omp_threads_bind,
        "CPUs the compute threads are bound to, one each, as vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND: auto (one CPU per physical core), nobind, or a list "
        "such as 0-3 or 0,2; with tensor parallelism one list per rank split by '|', "
        "e.g. 0|1 (auto: each rank its own cores)")
    step_profile_interval: int = _setting(WorkerConfig.step_profile_interval,
        "time one step in this many by part (linear layers, attention, other) for the "
        "metrics and the dashboard; the other steps run unhooked; 0: off")
    enforce_eager: bool = _setting(WorkerConfig.enforce_eager,
        "run every step layer by layer from Python: no captured steps (by default a "
        "Llama-family float32 model runs steps of 1-8 rows, where measured faster at "
        "start, as one native call)")
    huge_pages: bool = _setting(WorkerConfig.huge_pages,
        "copy the weights, and allocate the KV pools, on transparent huge pages where the "
        "kernel offers them (THP 'always' or 'madvise'): fewer TLB misses while a step "
        "streams them")
    tuning_plan: str | None = _setting(WorkerConfig.tuning_plan,
        "a tuning plan file (JSON): what start-up measured and chose (the few-row GEMV's "
        "weights, the panel GEMM's rows, the captured step's rows, the row padding, each "
        "layer's few-row path, speculative decoding's step costs); loaded if it exists, "
        "and then applied without measuring (refused if it was measured for another CPU, "
        "kernel build, model or setting), else measured and saved there")
    tuning_cache: bool = _setting(WorkerConfig.tuning_cache,
        "reuse the tuning plan that an earlier start measured for this CPU, kernel build, "
        "model and settings (kept under $KVSERVE_CACHE_DIR/tuning, ~/.cache/kvserve/tuning): "
        "a restart starts sooner and runs the same kernels; off: measure at every start")

    device: str = _setting(WorkerConfig.device,
        "where the model computes: cpu, cuda (a GPU: Triton paged attention, bfloat16 by "
        "default, the KV pool sized from free device memory) or auto (cuda when torch "
        "sees one)", choices=DEVICES)
    gpu_memory_utilization: float = _setting(WorkerConfig.gpu_memory_utilization,
        "cuda: the share of the device's memory the engine may use (weights, activations "
        "and the KV pool), as vLLM's")

    tensor_parallel_size: int = _setting(ParallelConfig.tensor_parallel_size,
        "ranks that split the model's heads, MLP and vocabulary between them, one "
        "process each, on torch.distributed's gloo over loopback")

    enable_lora: bool = _setting(
        False, "serve LoRA adapters (PEFT directories) beside the base model: a request "
        "names one by its model field (server) or lora_request (LLM.generate); requests "
        "for different adapters and the base share each step")
    max_loras: int = _setting(LoRAConfig.max_loras,
        "adapters one step may run (the worker's slots; requests for another adapter wait)")
    max_lora_rank: int = _setting(LoRAConfig.max_lora_rank,
        "largest adapter rank served (each slot is sized for it)")
    max_cpu_loras: int | None = _setting(LoRAConfig.max_cpu_loras,
        "adapters kept read in memory, least recently used dropped first (default: "
        "max_loras)")

    speculative_config: dict | str | None = _setting(None,
        "speculative decoding, as vLLM's (JSON on the command line), e.g. "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; drafts are verified "
        "exactly and used only where they pay")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every rule that needs no checkpoint; the model directory is read later, by
        :meth:`create_engine_config`."""
        check_model_settings(self.dtype, self.max_model_len, self.quantization)
        for f in fields(self):
            if "registry" in f.metadata:
                f.metadata["registry"].check(getattr(self, f.name))
        self.create_scheduler_config()
        self.create_cache_config()
        self.create_worker_config()
        self.create_speculative_config()
        self.create_parallel_config()
        self.create_lora_config()

    # -- the parts ---------------------------------------------------------------------

    def _part(self, part: type[Part], **derived) -> Part:
        """``part`` built from the settings of its fields' names, and ``derived``: the
        fields whose value another setting decides."""
        return part(**{f.name: getattr(self, f.name) for f in fields(part)
                       if f.name not in derived}, **derived)

    def create_scheduler_config(self) -> SchedulerConfig:
        return self._part(SchedulerConfig)

    def create_cache_config(self) -> CacheConfig:
        return self._part(CacheConfig, swap_enabled=self.preemption_mode == "swap")

    def create_worker_config(self) -> WorkerConfig:
        warmup_rows = self.max_num_seqs if self.gemm_warmup_rows is None else self.gemm_warmup_rows
        return self._part(WorkerConfig, gemm_warmup_rows=warmup_rows,
                          device=resolve_device(self.device))

    def create_parallel_config(self) -> ParallelConfig:
        return self._part(ParallelConfig)

    def create_lora_config(self) -> LoRAConfig | None:
        return self._part(LoRAConfig) if self.enable_lora else None

    def create_speculative_config(self) -> SpeculativeConfig | None:
        speculative = SpeculativeConfig.from_value(self.speculative_config)
        if speculative is not None:
            PROPOSERS.check(speculative.method)
        return speculative

    def create_engine_config(self) -> EngineConfig:
        """The validated parts; reads the model directory's config.json. Here also the
        rules that need the model or an implementation: the model split over the ranks,
        a KV manager that gives back rejected drafts' slots, a draft model that fits."""
        worker = self.create_worker_config()
        model = create_model_config(self.model, dtype=self.dtype, device=worker.device,
                                    max_model_len=self.max_model_len,
                                    quantization=self.quantization, seed=self.seed,
                                    generation_config=self.generation_config,
                                    attention_window=self.attention_window,
                                    attention_sinks=self.attention_sinks, runner=self.runner,
                                    gguf_activations=self.gguf_activations,
                                    tokenizer=self.tokenizer)
        parallel = self.create_parallel_config()
        if parallel.tensor_parallel_size > 1:
            check_shardable(model.arch, parallel.tensor_parallel_size)
        config = EngineConfig(model=model, cache=self.create_cache_config(),
                              scheduler=self.create_scheduler_config(), worker=worker,
                              speculative=self.create_speculative_config(), parallel=parallel,
                              lora=self.create_lora_config())
        if config.speculative is not None:
            if not KV_MANAGERS[config.cache.kv_manager].supports_truncate():
                raise ValueError(f"kv_manager {config.cache.kv_manager!r} cannot give back a "
                                 "rejected draft's KV slots: speculative_config needs a "
                                 "manager that implements truncate")
            if config.speculative.method == "draft_model":
                check_draft_model(config.speculative.model, config.model)
        return config

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
                kwargs["choices"] = kwargs.pop("registry").names()
            parser.add_argument(flag, type=_cli_type(f), default=None, help=text, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> EngineArgs:
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if getattr(args, f.name, None) is not None}
        given.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**given)

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)


def _cli_type(f: dataclasses.Field):
    if f.name in ("kv_cache_memory", "kv_offload_size"):
        return str  # sizes with units
    annotation = str(f.type)
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str

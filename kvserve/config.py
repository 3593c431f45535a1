"""EngineArgs: every engine setting in one validated dataclass.

The CLI flags are generated from these fields (``max_num_seqs`` -> ``--max-num-seqs``),
so the Python and command-line spellings never drift apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field, fields

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
               "g": 10**9, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30,
               "tib": 2**40, "t": 10**12, "tb": 10**12}

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_MANAGER_NAMES = ("paged", "buddy", "contiguous")
BATCHING_NAMES = ("continuous", "length-bucket", "static")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = ("auto", "torch")
QUANTIZATION_METHODS = ("int8",)
MAX_LINEAR_MIN_ROWS = 16


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,6"`` -> [0, 1, 2, 3, 6] (the format of taskset and vLLM's
    VLLM_CPU_OMP_THREADS_BIND); a CPU named twice or a malformed item is an error."""
    cpus: list[int] = []
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"CPU list {text!r}: {item.strip()!r} is not a CPU number or a "
                             "range a-b (expected e.g. '0-3,6')")
        cpus.extend(range(int(lo), int(hi if sep else lo) + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"CPU list {text!r} names a CPU more than once")
    return cpus


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string like ``"2GiB"`` / ``"512MB"`` / ``"1.5g"``."""
    if isinstance(value, bool):
        raise ValueError(f"a memory size must be bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"a memory size must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot read memory size {value!r}: use bytes or a number with a unit "
            f"({', '.join(u for u in _SIZE_UNITS if u)}), e.g. '2GiB'")
    size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return size


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
    # which delayed the first token: serving P99 TTFT 729 -> 672 ms on bench-100m);
    # offline throughput was the same at 512 and 2048.
    max_num_batched_tokens: int = field(default=2048, metadata=_help(
        "token budget of one engine step (prefill chunks + decodes)"))
    prefill_join_tokens: int = field(default=0, metadata=_help(
        "continuous batching: a waiting prompt joins a step only while the step's "
        "prefill tokens are fewer than this (0, the default: up to the budget); a later "
        "prompt then waits a step instead of delaying an earlier one's first token, at "
        "the cost of more steps that stall the decodes"))
    kv_manager: str = field(default="paged", metadata=_help(
        "KV memory design", choices=KV_MANAGER_NAMES))
    batching: str = field(default="continuous", metadata=_help(
        "batching policy", choices=BATCHING_NAMES))
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
        "per-token activation scales (about 4x the float32 GEMM speed on CPUs with "
        "VNNI); not bit-exact with the float model", choices=QUANTIZATION_METHODS))
    attention_backend: str = field(default="auto", metadata=_help(
        "auto (native attention and elementwise kernels when they build and the compute "
        "dtype is float32; oneDNN packed linear layers) or torch (gather + SDPA, F.linear)",
        choices=ATTENTION_BACKENDS))
    linear_min_rows: int | None = field(default=None, metadata=_help(
        "packed linear layers run GEMMs of fewer rows padded to this many (the real rows "
        "computed as in a GEMM of that size); default: measured at start among 1-8 rows "
        "on the model's own layers (some CPUs stream the weights of a 1-row GEMM slower "
        "than of a 6-row one); 1: no padding"))
    gemm_warmup_rows: int | None = field(default=None, metadata=_help(
        "at start, run each linear layer shape at every row count 1..N so that oneDNN has "
        "generated its GEMM kernels before the first steps need them (the CPU counterpart "
        "of capturing a CUDA graph per batch size); default: max_num_seqs; 0: off"))
    num_threads: int | None = field(default=None, metadata=_help(
        "torch threads (default: physical cores)"))
    omp_threads_bind: str = field(default="auto", metadata=_help(
        "CPUs the compute threads are bound to, one each, as vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND: auto (one CPU per physical core), nobind, or a list "
        "such as 0-3 or 0,2"))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.prefill_join_tokens, int) or self.prefill_join_tokens < 0:
            raise ValueError("prefill_join_tokens must be an integer >= 0 (0: no limit), "
                             f"got {self.prefill_join_tokens!r}")
        if self.linear_min_rows is not None:
            _positive_int("linear_min_rows", self.linear_min_rows)
            if self.linear_min_rows > MAX_LINEAR_MIN_ROWS:
                raise ValueError(f"linear_min_rows must be at most {MAX_LINEAR_MIN_ROWS}, got "
                                 f"{self.linear_min_rows}")
        if self.gemm_warmup_rows is not None and (
                not isinstance(self.gemm_warmup_rows, int) or self.gemm_warmup_rows < 0):
            raise ValueError("gemm_warmup_rows must be a non-negative integer (0: off), got "
                             f"{self.gemm_warmup_rows!r}")
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        if self.omp_threads_bind not in ("auto", "nobind"):
            parse_cpu_list(self.omp_threads_bind)
        _choice("kv_manager", self.kv_manager, KV_MANAGER_NAMES)
        _choice("batching", self.batching, BATCHING_NAMES)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if self.scheduling_policy == "priority" and self.batching != "continuous":
            raise ValueError("scheduling_policy 'priority' applies to continuous batching; "
                             f"batching is {self.batching!r}")
        _choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATION_METHODS)
        _number("swap_space", self.swap_space, low=0.0)
        parse_size(self.kv_offload_size)
        tiered = self.preemption_mode == "swap" or self.kv_offload_dir or self.warmup_prompts
        if tiered and self.kv_manager != "paged":
            raise ValueError("preemption_mode swap, kv_offload_dir and warmup_prompts need "
                             f"kv_manager 'paged', got {self.kv_manager!r}")
        if (self.kv_offload_dir or self.warmup_prompts) and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir and warmup_prompts work through the prefix cache: "
                             "enable_prefix_caching must be on")
        _positive_int("max_batch_size", self.max_batch_size)
        _number("bucket_window_s", self.bucket_window_s, low=0.0)
        _number("memory_pool_ratio", self.memory_pool_ratio, low=0.0, high=1.0,
                low_open=True)

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
            if isinstance(default, bool):
                flag = "--" + f.name.replace("_", "-")
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                    help=f"{kwargs['help']} (default: {default})")
                continue
            kind = _cli_type(f)
            parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None,
                                help=f"{kwargs.pop('help')} (default: {default})", **kwargs)

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


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _number(name: str, value: object, low: float, high: float = float("inf"),
            low_open: bool = False) -> None:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a number in {bounds}, got {value!r}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")

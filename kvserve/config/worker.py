"""WorkerConfig: how the worker runs the model on its platform (threads, kernels,
start-up measurements). The engine never reads it; the worker does."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.validate import choice, non_negative_int, optional_positive_int, \
    parse_cpu_list, positive_int

ATTENTION_BACKENDS = ("auto", "torch")
DEVICES = ("auto", "cpu", "cuda")
MAX_LINEAR_MIN_ROWS = 16


@dataclass(frozen=True)
class WorkerConfig:
    attention_backend: str = "auto"       # auto: native kernels and packed linears; torch
    linear_min_rows: int | None = None    # None: measured at start
    panel_gemm_max_rows: int | None = None  # None: measured at start; 0: oneDNN only
    gemm_warmup_rows: int | None = None   # None: max_num_seqs; 0: off
    num_threads: int | None = None        # None: physical cores
    omp_threads_bind: str = "auto"        # auto | nobind | a CPU list
    step_profile_interval: int = 16       # one step in N timed by part; 0: off
    enforce_eager: bool = False           # no captured steps: every step layer by layer
    huge_pages: bool = True               # weights and KV pools on transparent huge pages
    tuning_plan: str | None = None        # a plan file: loaded if there, else saved there
    tuning_cache: bool = True             # reuse the plan cached for this machine and model
    device: str = "auto"                  # cpu | cuda | auto (cuda when torch sees one)
    gpu_memory_utilization: float = 0.9   # cuda: the share of device memory kvserve uses

    def __post_init__(self) -> None:
        choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        choice("device", self.device, DEVICES)
        if not (isinstance(self.gpu_memory_utilization, (int, float))
                and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if self.linear_min_rows is not None:
            positive_int("linear_min_rows", self.linear_min_rows)
            if self.linear_min_rows > MAX_LINEAR_MIN_ROWS:
                raise ValueError(f"linear_min_rows must be at most {MAX_LINEAR_MIN_ROWS}, got "
                                 f"{self.linear_min_rows}")
        if self.panel_gemm_max_rows is not None:
            non_negative_int("panel_gemm_max_rows", self.panel_gemm_max_rows, "oneDNN only")
        if self.gemm_warmup_rows is not None:
            non_negative_int("gemm_warmup_rows", self.gemm_warmup_rows, "off")
        optional_positive_int("num_threads", self.num_threads)
        non_negative_int("step_profile_interval", self.step_profile_interval, "off")
        if self.omp_threads_bind not in ("auto", "nobind"):
            for part in self.omp_threads_bind.split("|"):  # '|': one list per rank
                parse_cpu_list(part)

    @property
    def native_kernels(self) -> bool:
        return self.attention_backend == "auto"

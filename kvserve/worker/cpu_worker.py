"""CPUWorker: runs the model on this machine's CPUs.

Start-up, in order: torch's thread count and the compute threads bound one to a CPU
(from the thread that will run the steps: its OpenMP team is the one bound), glibc
told to keep freed memory, the model loaded and its layers configured (native kernels
and oneDNN packed linears where they build and the dtype allows) and its large tensors
copied onto huge pages, the KV pool sized from the settings or the memory free and
allocated (on huge pages too), then the warm-up: a dummy step, every decode batch
size's GEMM kernels generated, the captured step (one native call for a few-row step)
timed against the eager one, and, unless the captured step took every few-row decode
step, the eager few-row GEMMs tuned (row padding, the native or dense path by layer).
Every choice start-up measures goes through one StartupTuner, whose TuningPlan a later
start on the same machine, model and settings loads instead of measuring
(``worker/tuning/plan.py``); it is saved once the engine is ready. Then the objects
alive are frozen out of the garbage collector's reach. The reasons for each step are in
the modules that implement them.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from kvserve.config.engine import EngineConfig
from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.kernels import NATIVE_KV_DTYPES, load_kernels
from kvserve.kernels.build import build_key
from kvserve.logger import init_logger
from kvserve.lora.manager import LoRAManager
from kvserve.model.registry import read_arch_config
from kvserve.model.execution import ExecutionMode, configure_layers
from kvserve.model.loader import load_model, stored_format
from kvserve.model.tensor_parallel import rank_arch
from kvserve.worker.captured_step import MAX_ROWS as CAPTURED_MAX_ROWS, CapturedStep, \
    unsupported_reason
from kvserve.worker.draft_runner import DraftRunner
from kvserve.worker.kv_pool_size import kv_cache_layout
from kvserve.worker.huge_pages import PoolPages, huge_pages_setting, move_to_huge_pages
from kvserve.core.kv.groups import engine_kv_groups
from kvserve.worker.model_runner import ModelRunner, kv_bytes_per_block
from kvserve.worker.platform import allowed_cpus, cpus_to_bind, freeze_startup_objects, \
    keep_freed_memory, physical_cores, return_freed_memory
from kvserve.worker.tuning.panel_gemm import pack_panel_weights, release_unread_copies
from kvserve.worker.tuning.plan import PlanStore, TuningPlan, plan_key, plan_path
from kvserve.worker.tuning.tuner import StartupTuner
from kvserve.worker.step_profiler import StepProfiler, StepTimeStats
from kvserve.worker.worker_base import DraftAsk, DraftModelInfo, DraftProposal, \
    KernelBuild, KVCacheLayout, ModelRunnerOutput, TransferStats, Worker

logger = init_logger(__name__)


class CPUWorker(Worker):
    def __init__(self, config: EngineConfig, model=None, tp=None) -> None:
        """``tp``: this rank's TensorParallelGroup (it then holds its share of the model
        and of each KV head's pool)."""
        self.config = config
        model_cfg, worker_cfg = config.model, config.worker
        self.arch = model_cfg.arch if tp is None else rank_arch(model_cfg.arch, tp)
        torch.set_num_threads(worker_cfg.num_threads or physical_cores())
        kernels = load_kernels() if worker_cfg.native_kernels else None
        self.kernels = kernels if kernels is not None and kernels.available else None
        self.tp = tp
        self.bound_cpus = self._bind_compute_threads()
        keep_freed_memory()
        start = time.perf_counter()
        self.model = model if model is not None else load_model(
            model_cfg.model_dir, model_cfg.arch, model_cfg.dtype, model_cfg.quantization, tp,
            gguf_activations=model_cfg.gguf_activations, weights_16bit=model_cfg.weights_16bit)
        self.mode = ExecutionMode(kernels=self.kernels, packed_linear=worker_cfg.native_kernels,
                                  linear_min_rows=worker_cfg.linear_min_rows or 1)
        configure_layers(self.model, self.mode)
        self.huge_pages = worker_cfg.huge_pages and self._huge_pages_offered()
        self.pool_pages = PoolPages()  # the KV pools' huge pages, backed on a thread
        self.plans = PlanStore(self._plan_path(""), worker_cfg.tuning_cache)
        self.tuner = StartupTuner(self._load_plan(self.plans, self.arch, "target",
                                                  self.config.model.model_dir))
        self._pack_panels(self.model, self.tuner)
        self._place_weights(self.model, "")
        self.profiler = StepProfiler(self.model, worker_cfg.step_profile_interval)
        self.lora = (None if config.lora is None else
                     LoRAManager(self.model, config.lora, model_cfg.dtype, self.kernels))
        if self.lora is not None:
            logger.info("LoRA: %d slots of rank %d in %d layers (%.1f MiB), up to %d adapters "
                        "read (%.1f MiB reserved in all)", config.lora.max_loras,
                        config.lora.max_lora_rank, len(self.lora.layers),
                        self.lora.slot_bytes / 2**20, config.lora.cache_size,
                        self.lora.reserved_bytes / 2**20)
        cache = config.cache
        self.kv_dtype = (model_cfg.dtype if cache.kv_cache_dtype == "auto"
                         else getattr(torch, cache.kv_cache_dtype))
        self.runner: ModelRunner | None = None
        self.draft: DraftRunner | None = None  # speculative decoding's draft model
        self.draft_plans = PlanStore(self._plan_path("draft"), worker_cfg.tuning_cache)
        self.draft_tuner: StartupTuner | None = None
        self._few_rows_tuned = False
        logger.info("loaded %s (%s, %s, %d threads) in %.1fs; max_model_len %d",
                    model_cfg.model_dir, model_cfg.arch.architecture, model_cfg.dtype,
                    torch.get_num_threads(), time.perf_counter() - start,
                    model_cfg.max_model_len)

    @property
    def linear_min_rows(self) -> int:
        return self.mode.linear_min_rows

    # -- threads ---------------------------------------------------------------------------

    def _bind_compute_threads(self) -> list[int] | None:
        """Bind torch's compute threads one to a CPU (``omp_threads_bind``), as vLLM's CPU
        worker does: unbound, the OS moves them between cores and stacks them with other
        threads. Returns the CPUs, or None when not bound."""
        threads = torch.get_num_threads()
        cpus = cpus_to_bind(self.config.worker.omp_threads_bind, threads)
        kernels = load_kernels()  # the binding call is native, whatever the attention
        if not kernels.available:
            logger.info("compute threads not bound: no native kernels (%s)", kernels.reason)
            return None
        if cpus is None:  # an earlier engine in this process may have bound the team
            if kernels.release_threads(allowed_cpus(), threads):
                logger.warning("compute threads could not all be let onto CPUs %s",
                               ",".join(map(str, allowed_cpus())))
            return None
        failed = kernels.bind_threads(cpus)
        if failed:
            raise RuntimeError(f"could not bind {failed} of {threads} compute threads to CPUs "
                               f"{cpus}")
        logger.info("compute threads bound to CPUs %s", ",".join(map(str, cpus)))
        return cpus

    # -- the tuning plan ----------------------------------------------------------------------

    def _plan_path(self, which: str) -> Path | None:
        return plan_path(self.config.worker.tuning_plan, which,
                         self.tp.rank if self.tp is not None else 0)

    def _load_plan(self, store: PlanStore, arch, role: str, model_dir) -> TuningPlan:
        """The plan for this model in ``role`` ("target" or "draft") here: stored (its
        choices applied without measuring), or empty (each choice measured and
        recorded). Models of one shape stored in different formats (GGUF files) have
        their own plans."""
        cfg = self.config
        settings = {"role": role, "threads": torch.get_num_threads(),
                    "tensor_parallel": None if self.tp is None else
                    f"{self.tp.rank}/{self.tp.size}",
                    "attention_backend": cfg.worker.attention_backend,
                    "huge_pages": self.huge_pages, "quantization": cfg.model.quantization,
                    "prompt_rows": cfg.scheduler.max_num_batched_tokens,
                    "stored": stored_format(Path(model_dir), cfg.model.gguf_activations)}
        key = plan_key(arch, cfg.model.dtype, build_key() if self.kernels else None, settings)
        plan = store.load(key)
        if store.source != "measured":
            logger.info("tuning plan for the %s model (%s) loaded from %s", role,
                        arch.architecture, store.source)
        return plan

    def _save_plans(self) -> None:
        for store, tuner in ((self.plans, self.tuner), (self.draft_plans, self.draft_tuner)):
            if tuner is not None:
                for path in store.save(tuner.plan):
                    logger.info("%stuning plan saved to %s", tuner.which, path)

    def tuning_plan(self) -> TuningPlan:
        return self.tuner.plan

    # -- memory ----------------------------------------------------------------------------

    @staticmethod
    def _huge_pages_offered() -> bool:
        setting = huge_pages_setting()
        if setting in ("always", "madvise"):
            return True
        logger.info("huge pages off: the kernel's transparent huge pages are %s", setting)
        return False

    def _place_weights(self, model, which: str) -> None:
        """The model's tensors onto huge pages (before anything keeps their
        addresses: the captured step's plan does)."""
        if self.huge_pages:
            moved = move_to_huge_pages(model)
            logger.info("%sweights: %.1f MiB on transparent huge pages", which, moved / 2**20)

    def _pack_panels(self, model, tuner: StartupTuner) -> None:
        """The float32 linear weights packed in panels for the native few-row GEMV, the
        captured step and the panel GEMM, and which copy the GEMV reads (measured).
        Before the other weights go onto huge pages, which then leave out the dense
        weights the panels hold (placed with them), and before the captured step's plan
        takes addresses. Tensor-parallel ranks keep to oneDNN's and the dense weights:
        the panel GEMM's choice times whole steps, which one rank cannot time alone."""
        if self.kernels is None or not self.mode.packed_linear or self.tp is not None:
            return
        packed = pack_panel_weights(model, self.kernels, self.huge_pages)
        if packed:
            logger.info("%sweights: %.1f MiB packed in panels%s", tuner.which, packed / 2**20,
                        " on transparent huge pages" if self.huge_pages else "")
        tuner.gemv_weights(model, self.kernels)

    @property
    def _pool_zeros(self):
        return self.pool_pages.zeros if self.huge_pages else torch.zeros

    # -- the KV pool -----------------------------------------------------------------------

    def determine_kv_cache_layout(self) -> KVCacheLayout:
        return kv_cache_layout(self.config, self.arch, self.kv_dtype,
                               self.tp.size if self.tp is not None else 1,
                               self.lora.reserved_bytes if self.lora is not None else 0)

    def initialize_kv_cache(self, layout: KVCacheLayout) -> None:
        cache = self.config.cache
        disk_path = (Path(cache.kv_offload_dir) / f"kvserve-kv-{os.getpid()}.bin"
                     if layout.disk_slots else None)
        # attention math is float32 whatever the compute dtype (see paged_attention); the
        # native kernel does not soft-cap scores
        attention = (self.kernels if self.kv_dtype in NATIVE_KV_DTYPES
                     and self.arch.attn_softcap is None and not self.arch.attention_sinks
                     else None)
        self.runner = ModelRunner(self.model, self.arch, layout, self.kv_dtype,
                                  self.config.model.seed, attention, disk_path, self._pool_zeros,
                                  engine_kv_groups(self.config))
        self.runner.captured = self._captured_step(self.runner, "")
        self.runner.lora = self.lora

    # -- warm-up -----------------------------------------------------------------------------

    def warm_up(self) -> None:
        if self.tp is not None:
            times = self.tp.choose_all_reduce(self.config.model.arch.hidden_size,
                                              self.config.model.dtype)
            if times and self.tp.rank == 0:
                logger.info("tensor parallel: one decode all-reduce takes %s; using %s",
                            ", ".join(f"{1e6 * t:.0f} us by {n}" for n, t in times.items()),
                            "shared memory" if self.tp.use_shm else "gloo")
        self.runner.warm_up(self.config.warmup_tokens)
        self._panel_gemms()
        self.tuner.warm_gemms(self.model, self.config.worker.gemm_warmup_rows)
        self.tuner.captured_rows(self.runner)
        if self.lora is None and self.tuner.captured_takes_every_few_row_step(self.runner):
            # row padding and the few-row paths tune eager steps of up to eight rows;
            # every decode step of so few rows now runs captured, on its own GEMV (a step
            # with LoRA adapters runs eager)
            logger.info("few-row GEMMs not tuned: steps of 1-%d decoding rows run captured",
                        CAPTURED_MAX_ROWS)
        else:
            self.tune_eager_few_rows()
        self._release_unread_copies(self.runner, "")

    @staticmethod
    def _release_unread_copies(runner: ModelRunner, which: str) -> None:
        captured = runner.captured
        if captured is not None and captured.max_rows == 0:
            runner.captured = captured = None  # not taken: its plan holds the weights
        panels, dense = release_unread_copies(
            runner.model, captured_reads=None if captured is None else
            "panels" if captured.on_panels else "dense")
        for nbytes, what in ((panels, "weights' panels released: no path reads them"),
                             (dense, "dense weights released: their panels or runs serve "
                                     "every few-row GEMM")):
            if nbytes:
                logger.info("%s%s (%.1f MiB)", which, what, nbytes / 2**20)

    def tune_eager_few_rows(self) -> None:
        """Measure and set how eager steps run their few-row GEMMs: the row padding
        (unless ``linear_min_rows`` is set) and each layer's native or dense path. Once
        per worker (padding is measured on unpadded layers)."""
        if self._few_rows_tuned:
            return
        self._few_rows_tuned = True
        if self.config.worker.linear_min_rows is None:
            self.mode = self.tuner.linear_min_rows(self.model, self.mode)
        self.tuner.layer_paths(self.model, self.kernels)

    def _captured_step(self, runner: ModelRunner, which: str) -> CapturedStep | None:
        """The runner's captured step, or None (eager enforced, or a model it cannot
        run: the reason is logged)."""
        if self.config.worker.enforce_eager:
            return None
        reason = unsupported_reason(runner.model, runner.caches, runner.native_attention)
        if reason:
            logger.info("%ssteps run eager: %s", which, reason)
            return None
        captured = CapturedStep(runner.model, runner.caches, runner.native_attention)
        captured.profiler = self.profiler if runner is self.runner else None
        return captured

    def _panel_gemms(self) -> None:
        """Give the native panel GEMM the row counts where it beats oneDNN, before the
        warm-up generates oneDNN's kernels for the rest."""
        if self.kernels is None or not self.mode.packed_linear:
            return
        if self.tp is not None:
            # each rank would time its own steps, whose all-reduces need every rank in
            # the same step; the ranks keep oneDNN's GEMMs
            logger.info("panel GEMM not measured under tensor parallelism: oneDNN's GEMMs")
            return
        runner = self.runner
        self.tuner.panel_rows(self.model, self.kernels, self.config.worker.panel_gemm_max_rows,
                              lambda n: runner.time_decodes(n, rounds=1, warm=False),
                              self.config.scheduler.max_num_batched_tokens)

    def finish_startup(self) -> None:
        self._save_plans()
        freeze_startup_objects()
        # the heap keeps what start-up freed (the weights as loaded, before their move to
        # huge pages; dense weights let go; warm-up activations) unless handed back
        return_freed_memory()
        # after the warm-up, whose GEMMs on every core it would slow: the first steps
        # write the pool's first blocks, which they back themselves if it is not there yet
        self.pool_pages.start()

    def settle(self) -> None:
        self.pool_pages.wait()

    # -- a draft model (speculative decoding) ----------------------------------------------

    def load_draft_model(self, model_dir: str) -> DraftModelInfo:
        """The draft model, its layers run as the target's, over a pool of as many blocks
        as the target's (the same tokens fit), warmed up."""
        start = time.perf_counter()
        arch = read_arch_config(Path(model_dir))
        model = load_model(model_dir, arch, self.config.model.dtype)
        configure_layers(model, self.mode)
        tuner = self.draft_tuner = StartupTuner(self._load_plan(self.draft_plans, arch, "draft",
                                                                model_dir),
                                                "draft model: ")
        self._pack_panels(model, tuner)
        self._place_weights(model, "draft model: ")
        tuner.layer_paths(model, self.kernels)
        dtype = self.config.model.dtype
        layout = self.kv_layout_for(arch, dtype)
        attention = (self.kernels if dtype in NATIVE_KV_DTYPES and arch.attn_softcap is None
                     and not arch.attention_sinks
                     else None)
        runner = ModelRunner(model, arch, layout, dtype, self.config.model.seed, attention,
                             zeros=self._pool_zeros)
        runner.warm_up(min(self.config.warmup_tokens, arch.max_position_embeddings - 1))
        tuner.warm_gemms(model, self.config.worker.gemm_warmup_rows)
        runner.captured = self._captured_step(runner, "draft model: ")
        tuner.captured_rows(runner)
        self._release_unread_copies(runner, "draft model: ")
        logger.info("draft model %s (%s, %d layers) loaded and warmed up in %.1fs; its KV: "
                    "%d blocks, %.1f MiB", model_dir, arch.architecture, arch.num_layers,
                    time.perf_counter() - start, layout.num_blocks,
                    layout.num_blocks * layout.bytes_per_block / 2**20)
        self.draft = DraftRunner(runner, layout.num_blocks, layout.block_size)
        return DraftModelInfo(layout.num_blocks, min(arch.max_position_embeddings,
                                                     self.config.model.max_model_len))

    def kv_layout_for(self, arch, dtype: torch.dtype) -> KVCacheLayout:
        """A pool for another model (a draft) with the target's block count and size."""
        bs = self.config.cache.block_size
        return KVCacheLayout(self.runner.caches[0].k.shape[0], bs,
                             kv_bytes_per_block(arch, bs, dtype),
                             str(dtype).removeprefix("torch."))

    def time_draft_model(self, batch_sizes: list[int], chunk_lengths: list[int]
                         ) -> tuple[dict[int, float], dict[int, float]]:
        runner, tuner = self.draft.runner, self.draft_tuner
        return (tuner.timings("draft_passes", batch_sizes, runner.time_decodes),
                tuner.timings("draft_catch_ups", chunk_lengths,
                              lambda rows: runner.time_rows(rows, all_rows_sample=False)))

    def propose_drafts(self, asks: list[DraftAsk]) -> DraftProposal:
        return self.draft.propose(asks)

    def forget_drafts(self, request_ids: list[str]) -> None:
        if self.draft is not None:
            self.draft.forget(request_ids)

    # -- steps -------------------------------------------------------------------------------

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.scheduled and self.profiler.due():
            return self.profiler.run(self.runner.execute, out)
        return self.runner.execute(out)

    def time_step_rows(self, row_counts: list[int]) -> dict[int, float]:
        if self.tp is not None:
            # every rank's steps run together (their all-reduces): a rank must never take
            # its own plan's costs while another measures, so ranks measure every time
            return self.runner.time_rows(row_counts)
        return self.tuner.timings("steps", row_counts, self.runner.time_rows)

    def step_time_stats(self) -> StepTimeStats:
        return self.profiler.stats()

    def kernel_build(self) -> KernelBuild:
        kernels = load_kernels()  # loaded at start whatever the attention: threads bind by it
        return KernelBuild(kernels.available, kernels.reason)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_int_id)

    def transfer_stats(self) -> TransferStats:
        mover = self.runner.mover
        return TransferStats(dict(mover.bytes_moved), dict(mover.seconds))

    def close(self) -> None:
        self.pool_pages.close()
        self._save_plans()  # what was measured after start-up (a later cost table)
        if self.runner is not None:
            self.runner.close()
        if self.draft is not None:
            self.draft.close()

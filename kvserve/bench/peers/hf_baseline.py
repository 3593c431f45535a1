"""The baseline of ``shared/BENCHMARKS.md``: HF transformers ``generate`` with static
batches.

Requests are cut into batches in arrival order; each batch is left-padded and run
with ``max_new_tokens`` = the batch's largest ``max_tokens``, greedy, EOS ignored
(``min_new_tokens = max_new_tokens``), float32, at the thread count given to the run
(torch's count restored after it, so that the baseline can share a process and rounds
with kvserve). Only each request's own ``max_tokens`` count as useful output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvserve.bench.instruments.roofline import torch_threads
from kvserve.bench.instruments.throughput import TokenRates
from kvserve.bench.workloads.definitions import BenchRequest

__all__ = ["HFBatchTiming", "HFResult", "load_hf_model", "run_hf_static", "sweep_hf_static"]


@dataclass
class HFBatchTiming:
    """One static batch: its size, padded prompt length, generated length and time."""

    index: int
    size: int
    padded_prompt_len: int
    max_new_tokens: int
    seconds: float


@dataclass
class HFResult(TokenRates):
    """Outcome of one HF static-batching run over a workload."""

    batch_size: int
    wall_s: float
    num_requests: int
    prompt_tokens: int
    useful_output_tokens: int
    generated_tokens: int  # including tokens past a request's own max_tokens
    batches: list[HFBatchTiming] = field(default_factory=list)


def load_hf_model(model_dir: str | Path) -> Any:
    """Load a causal LM in float32 for the baseline."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def _pad_id(model: Any) -> int:
    gc, cfg = model.generation_config, model.config
    for val in (gc.pad_token_id, getattr(cfg, "pad_token_id", None), gc.eos_token_id,
                getattr(cfg, "eos_token_id", None)):
        if isinstance(val, list):
            val = val[0] if val else None
        if isinstance(val, int):
            return val
    return 0


def _eos_ids(model: Any) -> list[int] | None:
    val = model.generation_config.eos_token_id
    if val is None:
        val = getattr(model.config, "eos_token_id", None)
    if val is None:
        return None
    return list(val) if isinstance(val, (list, tuple)) else [int(val)]


def _run_batch(model: Any, batch: Sequence[BenchRequest], pad_id: int) -> tuple[int, int, float]:
    """Generate one left-padded batch; returns (padded prompt len, new tokens, seconds)."""
    import torch

    plen = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), plen), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), plen), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, plen - r.prompt_len :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[i, plen - r.prompt_len :] = 1
    new = max(r.max_tokens for r in batch)
    eos = _eos_ids(model)
    kwargs: dict[str, Any] = dict(
        attention_mask=mask,
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=pad_id,
    )
    if eos is not None:
        # EOS ignored: the min-new-tokens processor masks EOS until the very end.
        kwargs.update(min_new_tokens=new, eos_token_id=eos)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    seconds = time.perf_counter() - t0
    generated = out.shape[1] - plen
    if generated != new:
        raise RuntimeError(f"HF generate stopped at {generated} of {new} new tokens")
    return plen, generated, seconds


def run_hf_static(
    model: Any, requests: Sequence[BenchRequest], batch_size: int = 16, warmup: bool = True,
    threads: int | None = 2,
) -> HFResult:
    """Run ``requests`` through ``model.generate`` in static batches of ``batch_size``
    on ``threads`` torch threads (None: torch's current count)."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    with torch_threads(threads):
        return _run_static_batches(model, requests, batch_size, warmup)


def _run_static_batches(model: Any, requests: Sequence[BenchRequest], batch_size: int,
                        warmup: bool) -> HFResult:
    pad_id = _pad_id(model)
    if warmup and requests:
        first = requests[0]
        _run_batch(model, [BenchRequest(first.prompt_token_ids[:8], 2)], pad_id)
    result = HFResult(batch_size, 0.0, len(requests), 0, 0, 0)
    for bi, start in enumerate(range(0, len(requests), batch_size)):
        batch = requests[start : start + batch_size]
        plen, generated, seconds = _run_batch(model, batch, pad_id)
        result.batches.append(HFBatchTiming(bi, len(batch), plen, generated, seconds))
        result.wall_s += seconds
        result.prompt_tokens += sum(r.prompt_len for r in batch)
        result.useful_output_tokens += sum(min(generated, r.max_tokens) for r in batch)
        result.generated_tokens += generated * len(batch)
    return result


def sweep_hf_static(
    model: Any, requests: Sequence[BenchRequest], batch_sizes: Sequence[int], warmup: bool = True,
    threads: int | None = 2,
) -> tuple[HFResult, list[HFResult]]:
    """Run every batch size; returns ``(best by useful tok/s, all results)``."""
    if not batch_sizes:
        raise ValueError("no batch sizes to sweep")
    results = [
        run_hf_static(model, requests, bs, warmup=warmup and i == 0, threads=threads)
        for i, bs in enumerate(batch_sizes)
    ]
    return max(results, key=lambda r: r.useful_tok_s), results

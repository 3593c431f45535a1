"""kvserve offline throughput (``kvserve bench throughput``).

Loads ``LLM(model=dir, **engine_args)``, then times one ``generate`` call over the
whole workload (greedy, ``ignore_eos``). Loading and a short warm-up are not timed.
Only each request's own ``max_tokens`` count as useful output tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvserve.bench.workloads.definitions import BenchRequest

__all__ = [
    "TokenRates",
    "ThroughputResult",
    "load_llm",
    "run_throughput",
    "generate_timed",
    "count_output_tokens",
]


class TokenRates:
    """The rates of a timed run over a workload, for a dataclass with the fields
    ``wall_s``, ``num_requests``, ``prompt_tokens`` and ``useful_output_tokens``, so that
    kvserve's runs and HF's are counted alike."""

    wall_s: float
    num_requests: int
    prompt_tokens: int
    useful_output_tokens: int

    def _per_s(self, count: int) -> float:
        return count / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def total_tokens(self) -> int:
        """Prompt tokens plus useful output tokens."""
        return self.prompt_tokens + self.useful_output_tokens

    @property
    def useful_tok_s(self) -> float:
        """Useful output tokens per second."""
        return self._per_s(self.useful_output_tokens)

    @property
    def total_tok_s(self) -> float:
        """(Prompt + useful output) tokens per second."""
        return self._per_s(self.total_tokens)

    @property
    def requests_per_s(self) -> float:
        """Completed requests per second."""
        return self._per_s(self.num_requests)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form with the derived rates."""
        d = asdict(self)
        d.update(
            total_tokens=self.total_tokens,
            useful_tok_s=self.useful_tok_s,
            total_tok_s=self.total_tok_s,
            requests_per_s=self.requests_per_s,
        )
        return d


@dataclass
class ThroughputResult(TokenRates):
    """Outcome of one timed kvserve ``generate`` over a workload."""

    wall_s: float
    num_requests: int
    prompt_tokens: int
    useful_output_tokens: int
    generated_tokens: int
    engine_args: dict[str, Any] = field(default_factory=dict)
    load_s: float = 0.0
    compute_dtype: str = ""  # the engine's activations and weights ("float32", ...)


def load_llm(model_dir: str | Path | None, engine_args: dict[str, Any]) -> tuple[Any, float]:
    """Construct ``kvserve.LLM``; returns ``(llm, seconds to ready)``, the engine settled
    (``LLMEngine.settle``) before it returns."""
    from kvserve import LLM

    t0 = time.perf_counter()
    llm = LLM(model=None if model_dir is None else str(model_dir), **engine_args)
    ready = time.perf_counter() - t0
    llm.engine.settle()  # what start-up left running stays out of the timed steps
    return llm, ready


def _sampling_params(max_tokens: int) -> Any:
    from kvserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate_timed(llm: Any, requests: Sequence[BenchRequest], progress: bool = False
                   ) -> tuple[float, list[Any]]:
    """One ``llm.generate`` over the requests (``progress``: with its progress bar, which
    updates a few times a second); returns ``(seconds, outputs)``."""
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    params = [_sampling_params(r.max_tokens) for r in requests]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    return time.perf_counter() - t0, list(outputs)


def count_output_tokens(requests: Sequence[BenchRequest], outputs: Sequence[Any]) -> tuple[int, int]:
    """``(useful, generated)`` output tokens: useful is min(generated, max_tokens) each."""
    if len(outputs) != len(requests):
        raise RuntimeError(f"generate returned {len(outputs)} outputs for {len(requests)} prompts")
    useful = generated = 0
    for req, out in zip(requests, outputs):
        n = len(out.outputs[0].token_ids)
        generated += n
        useful += min(n, req.max_tokens)
    return useful, generated


def run_throughput(
    model_dir: str | Path | None,
    requests: Sequence[BenchRequest],
    engine_args: dict[str, Any] | None = None,
    warmup: bool = True,
    llm: Any = None,
    progress: bool = False,
) -> ThroughputResult:
    """Time kvserve offline generation of ``requests`` (loads the engine unless ``llm``);
    ``progress`` shows a bar of the requests done."""
    engine_args = dict(engine_args or {})
    load_s = 0.0
    if llm is None:
        llm, load_s = load_llm(model_dir, engine_args)
    if warmup and requests:
        generate_timed(llm, [BenchRequest(list(requests[0].prompt_token_ids[:8]), 2)])
    llm.reset_prefix_cache()  # a repeat must compute its prompts, not find them cached
    wall_s, outputs = generate_timed(llm, requests, progress)
    useful, generated = count_output_tokens(requests, outputs)
    return ThroughputResult(
        wall_s=wall_s,
        num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        useful_output_tokens=useful,
        generated_tokens=generated,
        engine_args=engine_args,
        load_s=load_s,
        compute_dtype=str(llm.engine.config.model.dtype).removeprefix("torch."),
    )


def median_result(results: Sequence[ThroughputResult]) -> tuple[ThroughputResult, list[float]]:
    """The run with the median useful tok/s (the lower one of an even count), and every
    run's rate."""
    rates = [r.useful_tok_s for r in results]
    return results[rates.index(statistics.median_low(rates))], rates

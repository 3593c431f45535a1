"""Single-stream decode: one request's decode step time against the bandwidth floor.

At batch 1 a decode step must read every weight that takes part in a matmul once, so
``weight bytes / memory bandwidth`` is the least time a step can take. The step time
is measured by timing the engine's steps of one request after its prefill.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence


@dataclass
class DecodeResult:
    steps: int
    median_step_s: float
    weight_bytes: int

    @property
    def tok_s(self) -> float:
        return 1.0 / self.median_step_s if self.median_step_s > 0 else 0.0

    def vs_floor(self, bandwidth_gbs: float) -> float:
        """Measured step time / bandwidth floor (1.0 = at the floor)."""
        floor = self.weight_bytes / (bandwidth_gbs * 1e9)
        return self.median_step_s / floor if floor > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tok_s": self.tok_s}


def matmul_weight_bytes(model) -> int:
    """Bytes of the weights a decode step streams: every parameter and stored buffer
    (an int8 layer's weights and scales) except embedding lookup tables."""
    embeddings = {id(m.weight) for m in model.modules()
                  if type(m).__name__ == "Embedding"}
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:
        embeddings.discard(id(lm_head.weight))  # tied or not, the LM head is a matmul
    seen, total = set(), 0
    state = model.state_dict(keep_vars=True)  # no rotary tables: not stored
    # a weight let go (a meta tensor) counts for the layout read in its place (a float
    # weight's panels); a weight with runs of rows is read as those runs (counted
    # themselves), whether it was let go or is kept for another reader (a tied embedding,
    # listed under the embedding's name too)
    read_as_runs = {id(t) for name, t in state.items() if f"{name}_runs" in state}
    for t in state.values():
        if id(t) in seen or id(t) in embeddings or id(t) in read_as_runs:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def measure_decode(llm, prompt_token_ids: list[int], new_tokens: int = 64,
                   repeats: int = 3) -> DecodeResult:
    """Median decode step time of one request alone in the engine."""
    from kvserve import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    times: list[float] = []
    for r in range(repeats):
        engine.add_request(f"decode-bench-{r}", {"prompt_token_ids": prompt_token_ids}, params)
        engine.step()  # the prefill
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    return DecodeResult(len(times), statistics.median(times),
                        matmul_weight_bytes(engine.worker.runner.model))


def concurrent_decode_steps(engine, prompts: Sequence[list[int]], tag: str, new_tokens: int,
                            on_decode=None) -> list[float]:
    """Seconds of each engine step once every request of ``prompts`` (all added at
    once, ``new_tokens`` each) has its first token (the prefills done;
    ``on_decode()`` is called then) until all have finished."""
    from kvserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    if on_decode is not None:
        on_decode()
    steps = []
    while engine.has_unfinished_requests():
        begin = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - begin)
    return steps

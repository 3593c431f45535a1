"""Replaying a workload with its arrival times on a simulated clock.

The engine's steps run for real and the clock advances by each step's measured time;
between steps nothing runs, so an idle gap before the next arrival costs nothing but
is accounted for. A request arrives when the clock passes its arrival time; its time to
first token and time per output token are read on that clock. One candidate's replay
thus takes the compute time of the workload, not its wall-clock length.

What is not simulated: the server's own work (HTTP, detokenizing to JSON) and the
batching policies' windows, which keep reading the real clock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from kvserve.bench.workloads.definitions import BenchRequest
from kvserve.sampling_params import SamplingParams


@dataclass
class ReplayResult:
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)   # one per request with > 1 token
    output_tokens: int = 0
    duration_s: float = 0.0     # simulated: from the first arrival to the last finish
    compute_s: float = 0.0      # real time spent in steps
    preemptions: int = 0
    steps: int = 0
    peak_running: int = 0
    starved_steps: int = 0      # steps that left a running request out (the token budget)
    complete: bool = True       # False: stopped at the deadline


def replay(engine, requests: Sequence[BenchRequest], arrivals: Sequence[float] | None,
           deadline_s: float = float("inf"), concurrency: int | None = None) -> ReplayResult:
    """Run ``requests`` arriving at ``arrivals`` (seconds, ascending) through ``engine``;
    with ``arrivals`` None, as a closed loop: ``concurrency`` in flight, the next arriving
    when one finishes. Stops early (the result then covers the finished requests) once
    the real time spent passes ``deadline_s``."""
    out = ReplayResult()
    closed = arrivals is None
    released = min(concurrency or 1, len(requests))  # closed loop: requests sent so far
    if closed:  # arrival times become known as requests finish
        arrivals = [0.0] * released + [float("inf")] * (len(requests) - released)
    start_real = time.perf_counter()
    clock, nxt = arrivals[0] if arrivals else 0.0, 0
    first: dict[str, float] = {}
    base = engine.get_stats().scheduler.num_preemptions
    while nxt < len(requests) or engine.has_unfinished_requests():
        while nxt < len(requests) and arrivals[nxt] <= clock:
            req = requests[nxt]
            engine.add_request(f"r{nxt}", {"prompt_token_ids": list(req.prompt_token_ids)},
                               SamplingParams(temperature=0.0, max_tokens=req.max_tokens,
                                              ignore_eos=True))
            nxt += 1
        if not engine.has_unfinished_requests():
            clock = arrivals[nxt]  # idle until the next arrival
            continue
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t0
        clock += dt
        out.compute_s += dt
        out.steps += 1
        stats = engine.last_step_stats
        if stats is not None:
            out.peak_running = max(out.peak_running, stats.num_running)
            if stats.num_running > stats.num_scheduled_requests:
                out.starved_steps += 1
        for o in outputs:
            arrival = arrivals[int(o.request_id[1:])]
            tokens = sum(len(c.token_ids) for c in o.outputs)
            if tokens and o.request_id not in first:
                first[o.request_id] = clock
                out.ttft_s.append(clock - arrival)
            if o.finished:
                if closed and released < len(arrivals):
                    arrivals[released] = clock  # the loop sends the next one now
                    released += 1
                out.output_tokens += tokens
                if tokens > 1:
                    out.tpot_s.append((clock - first[o.request_id]) / (tokens - 1))
        if time.perf_counter() - start_real > deadline_s:
            out.complete = False
            break
    out.duration_s = clock - (arrivals[0] if arrivals else 0.0)
    out.preemptions = engine.get_stats().scheduler.num_preemptions - base
    return out

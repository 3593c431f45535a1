"""``kvserve bench overlap``: what async scheduling could gain on this machine.

Async scheduling (vLLM's) runs the engine's host work for one step (scheduling, applying
the sampled tokens, detokenizing, building outputs) while the model computes another.
It can gain at most that host work, and only if running it beside the model costs the
model nothing. Both are measured here, at each of a few batch sizes:

1. the host work per decode step: the engine step's wall time less the worker's
   (``execute_model``: inputs, model, sampling), over a real decode, and its share of
   the engine step;
2. a decode step of that many rows (:meth:`ModelRunner.time_decodes`' step) run alone,
   then followed by that much Python work (serial), and with the same work on a second
   thread while it computes (overlapped), in alternating order.

Overlapped faster than serial is what async scheduling needs; the Python work is a
busy loop holding the GIL as the engine's own does, on a helper thread started once.
Overlapped over serial is the median of the rounds' ratios (kvserve.bench.instruments.paired).
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable

import torch

from kvserve.bench.instruments.paired import paired_ratio, ratio_cell
from kvserve.core.scheduler_output import SamplingInfo, ScheduledRequest
from kvserve.sampling_params import SamplingParams
from kvserve.worker import compute_thread

BATCH_SIZES = (1, 16, 64)
CONTEXT = 128
NEW_TOKENS = 32


def host_seconds_per_step(engine, batch: int) -> tuple[float, float, int]:
    """Median seconds a decode step of ``batch`` requests spent outside the worker, the
    median engine step, and how many decode steps they are of."""
    worker = engine.worker
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = min(engine.vocab_size, 1000) - 3
    for i in range(batch):
        prompt = [3 + (i * 131 + j) % ids for j in range(CONTEXT)]
        engine.add_request(f"host-{batch}-{i}", {"prompt_token_ids": prompt}, params)
    inner: list[float] = []
    real = worker.execute_model

    def timed(out):
        begin = time.perf_counter()
        try:
            return real(out)
        finally:
            inner.append(time.perf_counter() - begin)
    worker.execute_model = timed
    host, whole = [], []
    try:
        while engine.has_unfinished_requests():
            begin = time.perf_counter()
            running = engine.scheduler.running
            decode = (bool(running) and not engine.scheduler.waiting
                      and all(r.num_computed_tokens >= CONTEXT for r in running))
            engine.step()
            if decode and inner:
                whole.append(time.perf_counter() - begin)
                host.append(whole[-1] - inner[-1])
    finally:
        worker.execute_model = real
    return statistics.median(host), statistics.median(whole), len(host)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(64))


class _Helper:
    """A thread that runs ``_busy(work_s)`` each time it is released: started once, so
    no sample pays for starting a thread."""

    def __init__(self, work_s: float) -> None:
        self.work_s = work_s
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self.go.acquire()
            if self.stopping:
                return
            _busy(self.work_s)
            self.done.release()

    def stop(self) -> None:
        self.stopping = True
        self.go.release()
        self.thread.join()


def overlap_times(runner, batch: int, work_s: float, repeats: int = 20) -> dict[str, float]:
    """Median seconds of a ``batch``-row decode step alone, followed by ``work_s`` of
    Python work, and with that work on a second thread while it runs. The step's K/V go
    to blocks no request holds (the caller empties the prefix cache after)."""
    bs, info = runner.block_size, SamplingInfo(SamplingParams(), (), (), None)
    blocks = CONTEXT // bs + 1
    if batch * blocks > runner.caches[0].k.shape[0]:
        raise ValueError(f"{batch} requests of {CONTEXT} tokens need {batch * blocks} KV "
                         f"blocks; the pool has {runner.caches[0].k.shape[0]}")
    step = [ScheduledRequest(f"overlap-{i}", [3], CONTEXT, list(range(i * blocks, (i + 1) * blocks)),
                             info) for i in range(batch)]
    inputs = runner.step_inputs(step)
    helper = _Helper(work_s)

    def forward() -> None:
        with torch.inference_mode():
            runner.forward(inputs)

    def serial() -> None:
        forward()
        _busy(work_s)

    def overlapped() -> None:
        helper.go.release()
        forward()
        helper.done.acquire()

    try:
        forward()
        samples: dict[str, list[float]] = {"alone": [], "serial": [], "overlapped": []}
        runs = {"alone": forward, "serial": serial, "overlapped": overlapped}
        for r in range(repeats):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                begin = time.perf_counter()
                runs[name]()
                samples[name].append(time.perf_counter() - begin)
    finally:
        helper.stop()
    return {name: statistics.median(v) for name, v in samples.items()}


def run_overlap_bench(model_dir: str, engine_args: dict[str, Any], rounds: int,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    from kvserve.bench.instruments.throughput import load_llm

    llm, _ = load_llm(model_dir, {"max_num_seqs": max(BATCH_SIZES), **engine_args})
    engine = llm.engine
    out: dict[str, Any] = {"rounds": rounds, "batches": {}}
    for batch in BATCH_SIZES:
        engine.reset_prefix_cache()
        host, whole, steps = host_seconds_per_step(engine, batch)
        per_round = [compute_thread().call(overlap_times, engine.worker.runner, batch, host)
                     for _ in range(rounds)]  # on the engine's own bound team
        engine.reset_prefix_cache()  # the timed steps overwrote free blocks
        med = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
        out["batches"][batch] = {
            "host_ms": 1000 * host, "engine_step_ms": 1000 * whole, "decode_steps": steps,
            "step_alone_ms": 1000 * med["alone"],
            "serial_ms": 1000 * med["serial"], "overlapped_ms": 1000 * med["overlapped"],
            "host_share": host / whole,
            "overlapped_vs_serial": paired_ratio([r["overlapped"] for r in per_round],
                                                 [r["serial"] for r in per_round])}
        b = out["batches"][batch]
        log(f"  {batch} requests: host work {b['host_ms']:.2f} ms a step "
            f"({100 * b['host_share']:.1f} %); step {b['step_alone_ms']:.2f} ms, then the "
            f"work {b['serial_ms']:.2f}, beside it {b['overlapped_ms']:.2f} "
            f"({ratio_cell(b['overlapped_vs_serial'])})")
    engine.close()
    return out


def cmd_overlap(args) -> int:
    """``kvserve bench overlap``."""
    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir
    from kvserve.bench.bench_setup import _header
    from kvserve.bench.reports import report

    model_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    info = _header("kvserve overlap", {"model": model_dir.name, "engine_args": engine_args,
                                       "rounds": args.rounds})
    result = run_overlap_bench(str(model_dir), engine_args, args.rounds)
    print(report.format_table(
        ["requests", "host ms/step", "host share", "step then work ms", "work beside ms",
         "beside / then"],
        [(n, b["host_ms"], f"{100 * b['host_share']:.1f}%", b["serial_ms"], b["overlapped_ms"],
          ratio_cell(b["overlapped_vs_serial"])) for n, b in result["batches"].items()]))
    if args.json:
        out = {"machine": info, "model": model_dir.name, "engine_args": engine_args,
               "result": result}
        print(f"wrote {report.write_json(args.json, out)}")
    return 0

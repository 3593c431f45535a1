"""Benchmark instruments for kvserve (``kvserve bench ...``).

One job per module:

- :mod:`kvserve.bench.models`: the deterministic random-weight bench models.
- :mod:`kvserve.bench.workloads`: the fixed workloads of ``shared/BENCHMARKS.md``.
- :mod:`kvserve.bench.roofline`: the machine's GEMM and bandwidth ceilings.
- :mod:`kvserve.bench.hf_baseline`: HF transformers static-batch ``generate``.
- :mod:`kvserve.bench.throughput`: kvserve offline throughput.
- :mod:`kvserve.bench.serve` / :mod:`kvserve.bench.serve_metrics`: serving load and metrics.
- :mod:`kvserve.bench.vllm_runner`: vLLM CPU offline throughput in a subprocess.
- :mod:`kvserve.bench.compare`: all of the above side by side in one run.
- :mod:`kvserve.bench.report` / :mod:`kvserve.bench.plots`: printing, JSON, PNG.
- :mod:`kvserve.bench.cli`: the ``kvserve bench`` argument parsers.

Nothing heavy is imported here: torch, transformers and matplotlib load lazily.
"""

"""Benchmark instruments for kvserve (``kvserve bench ...``).

The command line sits here: :mod:`~kvserve.bench.cli` (the argument parsers),
:mod:`~kvserve.bench.commands` and :mod:`~kvserve.bench.decoding_commands` (the handlers of
the sub-commands without a module of their own), :mod:`~kvserve.bench.bench_args` (the
argument groups they share) and :mod:`~kvserve.bench.bench_setup` (what every run prints
first and writes last). The rest is grouped by job:

- :mod:`kvserve.bench.workloads`: what a bench feeds an engine: the fixed workloads of
  ``shared/BENCHMARKS.md`` and the deterministic random-weight bench models.
- :mod:`kvserve.bench.instruments`: what measures: kvserve's offline throughput,
  single-stream decode, the serving load client and its metrics, the machine's roofline,
  the CPUs each system ran on, and the paired statistic every comparison reports.
- :mod:`kvserve.bench.peers`: the other systems run for comparison (HF transformers,
  vLLM, llama.cpp) and kvserve's own server as a subprocess.
- :mod:`kvserve.bench.reports`: printing and saving results (tables, JSON, PNG), where a
  result came from, and the figures the docs publish.
- :mod:`kvserve.bench.experiments`: one module per ``kvserve bench`` experiment that
  puts these together (compare, serving, memory, spec, captured, ...).

Nothing heavy is imported here: torch, transformers and matplotlib load lazily.
"""

"""What a bench feeds an engine: the fixed workloads of ``shared/BENCHMARKS.md``
(:mod:`~kvserve.bench.workloads.definitions`) and the deterministic random-weight bench
models (:mod:`~kvserve.bench.workloads.models`)."""

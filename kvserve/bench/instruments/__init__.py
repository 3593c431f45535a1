"""What measures: kvserve's offline throughput (:mod:`~kvserve.bench.instruments.throughput`)
and single-stream decode (:mod:`~kvserve.bench.instruments.decode`), the serving load client
(:mod:`~kvserve.bench.instruments.serve`) and its metrics
(:mod:`~kvserve.bench.instruments.serve_metrics`), the machine's ceilings
(:mod:`~kvserve.bench.instruments.roofline`), the CPUs each system ran on
(:mod:`~kvserve.bench.instruments.cpu_sets`) and the one statistic of "A against B"
(:mod:`~kvserve.bench.instruments.paired`)."""

"""Results on their way out: printing, tables and JSON (:mod:`~kvserve.bench.reports.report`),
PNG plots (:mod:`~kvserve.bench.reports.plots`), where a result came from
(:mod:`~kvserve.bench.reports.provenance`) and the figures the README and docs publish
(:mod:`~kvserve.bench.reports.published`)."""

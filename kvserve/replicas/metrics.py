"""The ingress's ``/metrics``: every replica's series with a ``replica`` label, plus the
router's own (its decisions, the prefix match of what it routed, replicas up and their
in-flight requests)."""
from __future__ import annotations

from typing import Iterable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

MATCH_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class RouterMetrics:
    def __init__(self, prefix: str, num_replicas: int) -> None:
        disable_created_metrics()  # as the engines' series: no *_created beside counters
        self.registry = CollectorRegistry()
        p = f"{prefix}:"
        self.decisions = Counter(p + "router_requests", "Requests routed, by replica and why "
                                 "(cache_hit, cache_miss, imbalance, round_robin).",
                                 ["replica", "reason"], registry=self.registry)
        self.match_ratio = Histogram(p + "router_prefix_match_ratio", "Share of a routed "
                                     "prompt's blocks the chosen replica had seen.",
                                     buckets=MATCH_BUCKETS, registry=self.registry)
        self.up = Gauge(p + "replica_up", "1 while the replica answers, 0 while it restarts.",
                        ["replica"], registry=self.registry)
        self.in_flight = Gauge(p + "replica_requests_in_flight", "Requests the ingress has "
                               "in flight at the replica.", ["replica"], registry=self.registry)
        self.failures = Counter(p + "replica_failures", "Requests ended because their "
                                "replica failed or died.", ["replica"], registry=self.registry)
        for i in range(num_replicas):
            self.up.labels(str(i)).set(1)
            self.in_flight.labels(str(i)).set(0)
            self.failures.labels(str(i))


class _Families:
    """A collector that yields already-parsed families (prometheus_client's protocol)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_replica_metrics(texts: dict[int, str], router: RouterMetrics) -> bytes:
    """One exposition: each family once, its samples from every replica labelled."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                         family.type, family.unit))
            for s in family.samples:
                into.samples.append(Sample(s.name, {**s.labels, "replica": str(replica)},
                                           s.value, s.timestamp, s.exemplar))
    registry = CollectorRegistry()
    registry.register(_Families(merged.values()))
    return generate_latest(registry) + generate_latest(router.registry)

"""ObservabilityConfig: what the server records about itself and where it sends it.
The engine never reads it; the server builds its recorder from it (kvserve.metrics)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.validate import choice

METRICS_PREFIXES = ("kvserve", "vllm")


@dataclass(frozen=True)
class ObservabilityConfig:
    served_model_name: str = "kvserve"
    enable_metrics: bool = True           # /metrics (Prometheus) and /v1/stats
    metrics_prefix: str = "kvserve"       # vllm: vLLM's names, for its dashboards and alerts
    log_stats_interval: float = 10.0      # seconds between throughput lines; 0: none
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for request spans

    def __post_init__(self) -> None:
        choice("metrics_prefix", self.metrics_prefix, METRICS_PREFIXES)
        if self.log_stats_interval < 0:
            raise ValueError(f"log_stats_interval must be >= 0, got {self.log_stats_interval}")

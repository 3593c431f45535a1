"""Observability: Prometheus series named like vLLM's, the live window behind the
dashboard, in-process alerts, and the recorder that feeds them from the engine thread."""
from __future__ import annotations

from kvserve.config.observability import METRICS_PREFIXES, ObservabilityConfig
from kvserve.metrics.live import LiveStats
from kvserve.metrics.prometheus import ServerMetrics
from kvserve.metrics.recorder import StatsRecorder
from kvserve.metrics.snapshot import EngineSnapshot

__all__ = ["EngineSnapshot", "LiveStats", "METRICS_PREFIXES", "ServerMetrics", "StatsRecorder",
           "create_recorder"]


def create_recorder(config: ObservabilityConfig, engine) -> StatsRecorder:
    """The recorder a server runs over ``engine`` (an LLMEngine, loaded)."""
    metrics = live = tracer = None
    if config.enable_metrics:
        info = engine.cache_config_info()
        metrics = ServerMetrics(config.served_model_name, engine.max_model_len,
                                config.metrics_prefix)
        metrics.publish_cache_config(info)
        if engine.config.lora is not None:
            metrics.enable_lora_info(engine.config.lora.max_loras)
        live = LiveStats(config.served_model_name, info["kv_manager"], info["num_kv_blocks"])
    if config.otlp_traces_endpoint:
        from kvserve.tracing import RequestTracer
        tracer = RequestTracer(config.otlp_traces_endpoint, config.served_model_name)
    return StatsRecorder(metrics, config.log_stats_interval, live=live, tracer=tracer)

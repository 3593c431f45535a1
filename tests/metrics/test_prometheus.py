"""ServerMetrics: vLLM v1's series with vLLM's names, types, labels and buckets."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.metrics import ServerMetrics
from kvserve.metrics.prometheus import one_two_five_buckets

# vLLM v1's Prometheus logger: name -> type (the LoRA gauge does not apply)
VLLM_SERIES = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge", "gpu_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
    "gpu_prefix_cache_queries": "counter", "gpu_prefix_cache_hits": "counter",
    "num_preemptions": "counter", "prompt_tokens": "counter", "generation_tokens": "counter",
    "request_success": "counter", "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram", "iteration_tokens_total": "histogram",
    "request_max_num_generation_tokens": "histogram", "request_params_n": "histogram",
    "request_params_max_tokens": "histogram", "time_to_first_token_seconds": "histogram",
    "time_per_output_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "time_per_prefill_token_request_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram", "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram", "cache_config_info": "gauge",
    "spec_decode_num_drafts": "counter", "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter",
    "spec_decode_num_accepted_tokens_per_pos": "counter",
}
# the upper bounds vLLM gives these histograms
VLLM_BUCKETS = {
    "time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                                    160.0, 640.0, 2560.0],
    "time_per_output_token_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                                      0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                                    1920.0, 7680.0],
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "request_params_n": [1, 2, 5, 10, 20],
    "request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
}


def families(metrics: ServerMetrics) -> dict:
    metrics.publish_cache_config({"block_size": 16, "kv_manager": "paged"})
    metrics.accepted_at(0).inc()
    metrics.time_to_first_token.observe(0.03)
    text = metrics.render()[0].decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("prefix", ["kvserve", "vllm"])
def test_every_vllm_series_with_its_type_and_labels(prefix):
    found = families(ServerMetrics("m", max_model_len=2048, prefix=prefix))
    for name, kind in VLLM_SERIES.items():
        # the parser drops a counter's _total; vLLM's iteration_tokens_total keeps its name
        fam = found.get(f"{prefix}:{name}")
        assert fam is not None, name
        assert fam.type == kind, name
        for sample in fam.samples:
            assert sample.labels["engine"] == "0", name
            if name != "cache_config_info":
                assert sample.labels["model_name"] == "m", name
    assert not [n for n in found if not n.startswith(f"{prefix}:")]


def test_buckets_are_vllms():
    found = families(ServerMetrics("m", max_model_len=2048))
    for name, bounds in VLLM_BUCKETS.items():
        les = [s.labels["le"] for s in found[f"kvserve:{name}"].samples
               if s.name.endswith("_bucket")]
        assert [float(x) for x in les[:-1]] == [float(b) for b in bounds], name
        assert les[-1] == "+Inf"


def test_finish_reasons_and_no_created_series():
    text = ServerMetrics("m").render()[0].decode()
    for reason in ("stop", "length", "abort", "error"):
        assert f'finished_reason="{reason}"' in text
    assert "_created" not in text


def test_one_two_five_buckets():
    assert one_two_five_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert one_two_five_buckets(4) == [1, 2]


def test_unknown_prefix_is_refused():
    with pytest.raises(ValueError, match="kvserve, vllm"):
        ServerMetrics("m", prefix="sglang")

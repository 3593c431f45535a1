"""StatsRecorder: one request's life turned into vLLM's series, the live window, a span."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvserve.core.kv.interface import KVStats
from kvserve.core.scheduler_output import SchedulerStats
from kvserve.metrics import EngineSnapshot, LiveStats, ServerMetrics, StatsRecorder
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams


def samples(metrics: ServerMetrics) -> dict:
    text = metrics.render()[0].decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}"
                            if extra else "")
            out[key] = s.value
    return out


def output(rid, tokens, finished=False, reason=None, t=None, prompt=(1, 2, 3)):
    return RequestOutput(rid, None, list(prompt), [CompletionOutput(
        0, "", list(tokens), finish_reason=reason)], finished, metrics=t)


def test_a_request_from_add_to_finish():
    m, live = ServerMetrics("m", max_model_len=256), LiveStats("m")
    rec = StatsRecorder(m, log_interval=0, live=live)
    rec.on_add("r", SamplingParams(n=1, max_tokens=8), arrival_time=10.0)
    t = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0)
    rec.on_outputs([output("r", [5], t=t)], now=11.0)
    rec.on_outputs([output("r", [5, 6, 7], t=t)], now=11.2)   # two tokens in one step
    t.finished_time = 11.4
    rec.on_outputs([output("r", [5, 6, 7, 8], True, "length", t)], now=11.4)
    s = samples(m)
    assert s["kvserve:prompt_tokens_total"] == 3 and s["kvserve:generation_tokens_total"] == 4
    assert s["kvserve:request_success_total{finished_reason=length}"] == 1
    assert s["kvserve:time_to_first_token_seconds_sum"] == 1.0
    assert s["kvserve:inter_token_latency_seconds_count"] == 2
    assert s["kvserve:time_per_output_token_seconds_count"] == 2
    assert abs(s["kvserve:e2e_request_latency_seconds_sum"] - 1.4) < 1e-9
    assert abs(s["kvserve:request_queue_time_seconds_sum"] - 0.5) < 1e-9
    assert abs(s["kvserve:request_inference_time_seconds_sum"] - 0.9) < 1e-9
    assert abs(s["kvserve:request_prefill_time_seconds_sum"] - 0.5) < 1e-9
    assert abs(s["kvserve:request_decode_time_seconds_sum"] - 0.4) < 1e-9
    assert abs(s["kvserve:time_per_prefill_token_request_seconds_sum"] - 0.5 / 3) < 1e-9
    assert s["kvserve:request_generation_tokens_sum"] == 4
    assert s["kvserve:request_max_num_generation_tokens_sum"] == 4
    assert s["kvserve:request_prompt_tokens_sum"] == 3
    assert s["kvserve:request_params_n_sum"] == 1
    assert s["kvserve:request_params_max_tokens_sum"] == 8
    assert [v for _, v in live.ttft] == [1.0]
    assert [round(v, 6) for _, v in live.tpot] == [0.1, 0.2]  # per token: 0.2 s / 2 tokens


def test_aborts_and_errors_count_as_failed():
    m, live = ServerMetrics("m"), LiveStats("m")
    rec = StatsRecorder(m, log_interval=0, live=live)
    rec.on_add("a", SamplingParams(), 1.0)
    rec.on_abort("a")
    bad = output("b", [], True, "error")
    bad.error = "internal error"
    rec.on_outputs([bad], now=2.0)
    rec.on_state(EngineSnapshot())
    s = samples(m)
    assert s["kvserve:request_success_total{finished_reason=abort}"] == 1
    assert s["kvserve:request_success_total{finished_reason=error}"] == 1
    assert live.view()["requests"] == {"finished": 2, "failed": 2}


def test_steps_and_state():
    m = ServerMetrics("m")
    rec = StatsRecorder(m, log_interval=0)
    kv = KVStats(num_blocks=10, block_size=16, num_used_blocks=9, used_tokens=100,
                 allocated_slots=144)
    rec.on_step(SchedulerStats(3, 1, 0, kv, num_scheduled_tokens=70, num_decode_requests=2),
                [], now=1.0)
    snap = EngineSnapshot(num_running=3, num_waiting=1, kv_usage=0.9, num_preemptions=2,
                          prefix_queries=50, prefix_hits=20,
                          step_seconds={"linear": 0.5, "attention": 0.2, "other": 0.1},
                          profiled_steps=4)
    rec.on_state(snap)
    rec.on_state(snap)  # counters follow cumulative totals: no double counting
    s = samples(m)
    assert s["kvserve:iteration_tokens_total_sum"] == 70
    assert s["kvserve:iteration_decode_requests_sum"] == 2
    assert s["kvserve:iteration_prefill_tokens_sum"] == 68
    assert s["kvserve:num_preemptions_total"] == 2
    assert s["kvserve:prefix_cache_hits_total"] == 20 == s["kvserve:gpu_prefix_cache_hits_total"]
    assert s["kvserve:kv_cache_usage_perc"] == 0.9 == s["kvserve:gpu_cache_usage_perc"]
    assert s["kvserve:step_time_seconds_total{part=linear}"] == 0.5
    assert s["kvserve:profiled_steps_total"] == 4
    assert s["kvserve:engine_healthy"] == 1
    rec.on_state(snap, alive=False)
    assert samples(m)["kvserve:engine_healthy"] == 0


def test_structured_requests_are_counted():
    from kvserve.structured_output.params import StructuredOutputsParams
    m = ServerMetrics("m")
    rec = StatsRecorder(m, log_interval=0)
    rec.on_add("s", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")), 0.0)
    rec.on_add("p", SamplingParams(), 0.0)
    assert samples(m)["kvserve:structured_output_requests_total"] == 1


def test_the_stats_line_says_why_after_a_condition_held(caplog):
    import logging

    log = logging.getLogger("test.diagnostics")
    rec = StatsRecorder(None, log_interval=1.0, log=log)
    kv = KVStats(num_blocks=10, block_size=16, num_used_blocks=10, used_tokens=160,
                 allocated_slots=160)
    starved = SchedulerStats(8, 4, 0, kv, num_scheduled_tokens=8, num_scheduled_requests=4)
    with caplog.at_level(logging.INFO, logger="test.diagnostics"):
        for interval in range(1, 5):
            rec.on_step(starved, [], now=float(interval))
            rec.on_outputs([], now=float(interval))
            rec.maybe_log(EngineSnapshot(num_running=8, num_waiting=4,
                                         num_preemptions=interval), now=rec._last_log + 1.5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # each once, after three intervals in a row
    assert any("KV pool too small" in w for w in warnings)
    assert any("token budget starves decodes: 100%" in w for w in warnings)

"""Request spans: vLLM's llm_request with gen_ai attributes, one event per stage, the
caller's trace continued."""
from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvserve.metrics import StatsRecorder
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tracing import RequestTracer, trace_headers

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_span_per_request_with_its_stages():
    exporter = InMemorySpanExporter()
    rec = StatsRecorder(None, log_interval=0, tracer=RequestTracer(exporter=exporter))
    rec.on_add("r1", SamplingParams(temperature=0.5, max_tokens=4), 100.0,
               trace_headers({"traceparent": PARENT, "user-agent": "x"}))
    rec.on_step(None, ["r1"], now=100.7)
    t = RequestMetrics(100.0, first_scheduled_time=100.2, first_token_time=100.5,
                       finished_time=101.0)
    rec.on_outputs([RequestOutput("r1", None, [1, 2, 3], [CompletionOutput(
        0, "", [4, 5], finish_reason="length")], True, metrics=t)], now=101.0)
    rec.on_add("r2", SamplingParams(), 102.0)
    rec.on_abort("r2")
    first, aborted = exporter.get_finished_spans()
    assert first.name == "llm_request"
    assert [e.name for e in first.events] == ["queued", "scheduled", "first_token",
                                              "preempted", "finished"]
    assert abs((first.end_time - first.start_time) / 1e9 - 1.0) < 1e-6
    a = first.attributes
    assert a["gen_ai.request.id"] == "r1" and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.usage.prompt_tokens"] == 3 and a["gen_ai.usage.completion_tokens"] == 2
    assert abs(a["gen_ai.latency.time_to_first_token"] - 0.5) < 1e-9
    assert abs(a["gen_ai.latency.time_in_queue"] - 0.2) < 1e-9
    assert first.context.trace_id == int(PARENT.split("-")[1], 16)
    assert first.parent.span_id == int(PARENT.split("-")[2], 16)
    assert aborted.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert aborted.parent is None


def test_no_trace_headers():
    assert trace_headers({"content-type": "application/json"}) is None

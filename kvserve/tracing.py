"""Request traces as OpenTelemetry spans (``--otlp-traces-endpoint``, vLLM's flag).

One span per request, ``llm_request`` as in vLLM, from arrival to finish, with
vLLM's ``gen_ai.*`` attributes and one event per stage of its life: queued,
scheduled, first_token, preempted (each time), finished. A ``traceparent`` header on
the HTTP request makes the span a child of the caller's trace. The span is built when
the request ends, from the times the engine recorded, so tracing costs nothing per
step; the exporter sends batches from its own thread.
"""
from __future__ import annotations

import time

from kvserve.logger import init_logger

logger = init_logger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")


def trace_headers(headers) -> dict[str, str] | None:
    """The W3C trace-context headers of an HTTP request, if any."""
    found = {k: headers[k] for k in TRACE_HEADERS if k in headers}
    return found or None


class RequestTracer:
    def __init__(self, endpoint: str | None = None, service_name: str = "kvserve",
                 exporter=None) -> None:
        """Spans go to the OTLP/HTTP collector at ``endpoint``, or to ``exporter`` (tests
        pass an in-memory one, exported synchronously)."""
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import \
                TraceContextTextMapPropagator
        except ImportError as e:
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install "
                             "'kvserve[tracing]'") from e
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint)))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kvserve")
        self._propagator = TraceContextTextMapPropagator()
        # engine times are time.monotonic(); spans want epoch nanoseconds
        self._epoch_offset = time.time() - time.monotonic()

    def context_of(self, headers: dict | None):
        return self._propagator.extract(headers) if headers else None

    def _ns(self, t: float) -> int:
        return int((t + self._epoch_offset) * 1e9)

    def end(self, rec, out, reason: str, now: float) -> None:
        """Build and end the span of a finished (or aborted: ``out`` None) request."""
        t = out.metrics if out is not None else None
        finished = t.finished_time if t is not None and t.finished_time else now
        span = self.tracer.start_span("llm_request", context=rec.trace_context,
                                      start_time=self._ns(rec.arrival_time))
        span.add_event("queued", timestamp=self._ns(rec.arrival_time))
        if t is not None and t.first_scheduled_time is not None:
            span.add_event("scheduled", timestamp=self._ns(t.first_scheduled_time))
        if t is not None and t.first_token_time is not None:
            span.add_event("first_token", timestamp=self._ns(t.first_token_time))
        for when in rec.preempted_at:
            span.add_event("preempted", timestamp=self._ns(when))
        span.add_event("finished", {"finish_reason": reason}, timestamp=self._ns(finished))
        span.set_attributes(self._attributes(rec, out, reason, finished))
        span.end(end_time=self._ns(finished))

    @staticmethod
    def _attributes(rec, out, reason: str, finished: float) -> dict:
        attrs = {"gen_ai.request.id": rec.request_id,
                 "gen_ai.response.finish_reasons": [reason],
                 "gen_ai.request.n": rec.n, "gen_ai.latency.e2e": finished - rec.arrival_time}
        params = rec.params
        for name in ("temperature", "top_p", "max_tokens"):
            value = getattr(params, name, None)
            if value is not None:
                attrs[f"gen_ai.request.{name}"] = value
        if out is None:
            return attrs
        attrs["gen_ai.usage.prompt_tokens"] = len(out.prompt_token_ids)
        attrs["gen_ai.usage.completion_tokens"] = sum(len(o.token_ids) for o in out.outputs)
        t = out.metrics
        if t is not None and t.first_scheduled_time is not None:
            attrs["gen_ai.latency.time_in_queue"] = t.first_scheduled_time - t.arrival_time
            attrs["gen_ai.latency.time_in_model_inference"] = finished - t.first_scheduled_time
            if t.first_token_time is not None:
                attrs["gen_ai.latency.time_to_first_token"] = t.first_token_time - t.arrival_time
                attrs["gen_ai.latency.time_in_model_prefill"] = (t.first_token_time
                                                                 - t.first_scheduled_time)
                attrs["gen_ai.latency.time_in_model_decode"] = finished - t.first_token_time
        return attrs

    def shutdown(self) -> None:
        self.provider.shutdown()

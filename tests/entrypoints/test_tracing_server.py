"""--otlp-traces-endpoint on a real server: spans reach an OTLP/HTTP receiver on loopback."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.entrypoints.conftest import ServerProcess

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


class Receiver(BaseHTTPRequestHandler):
    spans: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                Receiver.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_spans_are_exported_with_the_callers_trace(llama_dir, tmp_path):
    receiver = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_port}/v1/traces"
    server = ServerProcess(llama_dir, tmp_path / "traced.log", "--otlp-traces-endpoint", endpoint)
    try:
        server.wait_healthy()
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"},
                       json={"prompt": "hello", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200
    finally:
        assert server.terminate() == 0  # shutdown flushes the batched spans
        receiver.shutdown()
    span, = [s for s in Receiver.spans if s.name == "llm_request"]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == "00f067aa0ba902b7"
    assert [e.name for e in span.events] == ["queued", "scheduled", "first_token", "finished"]
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 5

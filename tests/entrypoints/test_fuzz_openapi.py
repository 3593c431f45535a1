"""schemathesis over the server's own OpenAPI document: no 5xx, every error an OpenAI
error body, responses as documented; the engine alive and every KV block free after.

``positive_data_acceptance`` is left out: a body valid by the schema can still be one the
server must refuse (token ids beyond the vocabulary, a prompt longer than max_model_len,
tool-call arguments that are not JSON), and its 400 is the right answer."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ST = shutil.which("st") or str(Path(sys.executable).with_name("st"))


def _fuzz(server, phases: str, examples: int, timeout: float) -> None:
    assert Path(ST).exists(), "schemathesis is missing: install the dev extra"
    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
            "/v1/models", "/health", "/metrics"} <= set(doc["paths"])
    run = subprocess.run([ST, "run", f"{server.url}/openapi.json", "--checks", "all",
                          "--exclude-checks", "positive_data_acceptance", "--max-examples",
                          str(examples), "--seed", "7", "--phases", phases,
                          # a boundary body (n=127 at the longest output) takes over
                          # schemathesis' default 10 s on a slow 2-core machine: a slow
                          # answer is not a wrong one
                          "--request-timeout", "60", "--max-response-time", "60"],
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert httpx.get(f"{server.url}/health").status_code == 200
    m = server.metrics()
    assert m["kvserve:num_requests_running"] == 0 and m["kvserve:kv_cache_usage_perc"] == 0


@pytest.mark.slow  # (15-25 s: `make test` stays near 10 minutes)
def test_fuzzed_requests_get_documented_answers(server):
    _fuzz(server, "fuzzing,stateful", examples=40, timeout=300)


@pytest.mark.slow
def test_boundary_values_of_every_field(server):
    _fuzz(server, "examples,coverage", examples=20, timeout=1200)

"""A real Prometheus (Debian's) scraping real kvserve servers under load.

Two servers: one named like vLLM (``--metrics-prefix vllm``) runs a bounded load whose
count, tokens and TTFTs the client records, and must read the same in Prometheus; vLLM's
dashboard queries must all answer. The other (``kvserve:`` names, a tiny KV pool) is
driven past 85 % KV usage until the shipped KVCacheUsageHigh rule is pending in
Prometheus' /api/v1/alerts. Prometheus runs with the shipped scrape config and rules,
only its targets and intervals changed.
"""
from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.deploy.tools import require_tool
from tests.entrypoints.conftest import ServerProcess, free_port

pytestmark = pytest.mark.slow

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
NUM_REQUESTS = 24

# the series vLLM's example Grafana dashboard queries, in its query forms
VLLM_DASHBOARD_QUERIES = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{m}[1m])))',
    'rate(vllm:e2e_request_latency_seconds_sum{m}[1m]) / rate(vllm:e2e_request_latency_seconds_count{m}[1m])',
    'rate(vllm:prompt_tokens_total{m}[1m])',
    'rate(vllm:generation_tokens_total{m}[1m])',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{m}[1m])))',
    'rate(vllm:time_per_output_token_seconds_sum{m}[1m]) / rate(vllm:time_per_output_token_seconds_count{m}[1m])',
    'vllm:num_requests_running{m}',
    'vllm:num_requests_waiting{m}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{m}[1m])))',
    'vllm:gpu_cache_usage_perc{m}',
    'vllm:kv_cache_usage_perc{m}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{m}[1m]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{m}[1m]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{m}[1m]))',
    'rate(vllm:request_queue_time_seconds_sum{m}[1m])',
    'rate(vllm:request_prefill_time_seconds_sum{m}[1m])',
    'rate(vllm:request_decode_time_seconds_sum{m}[1m])',
    'rate(vllm:request_max_num_generation_tokens_sum{m}[1m])',
]


class Prometheus:
    def __init__(self, workdir: Path, targets: dict[str, str]) -> None:
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(DEPLOY / f) for f in config["rule_files"]]
        template = config["scrape_configs"][0]
        config["scrape_configs"] = [
            {**template, "job_name": job, "scrape_interval": "1s",
             "static_configs": [{"targets": [target]}]} for job, target in targets.items()]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self._log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [require_tool("prometheus", "prometheus"),
             f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url[7:]}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.log_path = workdir / "prometheus.log"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"prometheus not ready:\n{self.log_path.read_text()}")

    def query(self, expr: str) -> list:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float:
        result = self.query(expr)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def wait_scraped(self, job: str, after: float) -> None:
        """Until every target of ``job`` was scraped after ``after`` (unix s)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            targets = httpx.get(f"{self.url}/api/v1/targets").json()["data"]["activeTargets"]
            mine = [t for t in targets if t["labels"]["job"] == job]
            if mine and all(t["health"] == "up" and _unix(t["lastScrape"]) > after for t in mine):
                return
            time.sleep(0.3)
        raise AssertionError(f"{job} not scraped: {targets}")

    def wait_for(self, expr: str, timeout: float = 20.0) -> None:
        """Until ``expr`` has a result (rates need a few samples in their window)."""
        deadline = time.monotonic() + timeout
        while not self.query(expr):
            assert time.monotonic() < deadline, f"no result for {expr}"
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
        self._log.close()


def _unix(rfc3339: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("prometheus")
    vllm_named = ServerProcess(llama_dir, work / "vllm-named.log", "--metrics-prefix", "vllm",
                               "--served-model-name", "vm")
    tiny_pool = ServerProcess(llama_dir, work / "tiny-pool.log", "--served-model-name", "tiny",
                              "--num-kv-blocks", "12", "--block-size", "16",
                              "--max-num-seqs", "4")
    prom = None
    try:
        vllm_named.wait_healthy()
        tiny_pool.wait_healthy()
        prom = Prometheus(work, {"vllm-named": f"127.0.0.1:{vllm_named.port}",
                                 "kvserve": f"127.0.0.1:{tiny_pool.port}"})
        yield prom, vllm_named, tiny_pool
    finally:
        if prom is not None:
            prom.stop()
        for server in (vllm_named, tiny_pool):
            server.terminate()


def _timed_request(client: openai.OpenAI, i: int) -> tuple[float, float, int]:
    """(time to first text, time to the end, completion tokens) as the client saw them."""
    start = time.monotonic()
    ttft, tokens = None, 0
    stream = client.completions.create(
        model="vm", prompt=f"request {i}: the numbers are", max_tokens=8 + i % 9,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.monotonic() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return ttft, time.monotonic() - start, tokens


def _assert_nested(prom: Prometheus, histogram: str, client_seconds: list[float]) -> None:
    """Each request's server-side interval lies inside the client's, so for every bucket
    at least as many server observations as client times fall at or under its bound."""
    series = prom.query(f'sum by (le) ({histogram}_bucket{{model_name="vm"}})')
    counts = {float(s["metric"]["le"]): float(s["value"][1]) for s in series}
    assert counts[float("inf")] == len(client_seconds), counts
    for le, count in sorted(counts.items()):
        client_count = sum(t <= le for t in client_seconds)
        assert count >= client_count, (histogram, le, count, client_count, client_seconds)


def test_prometheus_sees_what_the_client_saw(stack):
    prom, server, _ = stack
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client, \
            ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: _timed_request(client, i), range(NUM_REQUESTS)))
    done = time.time()
    prom.wait_scraped("vllm-named", done)
    m = '{model_name="vm"}'
    prom.wait_for(f"count_over_time(vllm:e2e_request_latency_seconds_count{m}[1m]) >= 3")
    assert prom.value(f"sum(vllm:request_success_total{m})") == NUM_REQUESTS
    assert prom.value('vllm:request_success_total{model_name="vm",finished_reason="length"}') \
        == NUM_REQUESTS
    assert prom.value(f"vllm:generation_tokens_total{m}") == sum(t for _, _, t in results)
    assert prom.value(f"vllm:time_to_first_token_seconds_count{m}") == NUM_REQUESTS

    # the server's TTFT and latency start after the client sent and end before it read
    _assert_nested(prom, "vllm:time_to_first_token_seconds", [t for t, _, _ in results])
    _assert_nested(prom, "vllm:e2e_request_latency_seconds", [e for _, e, _ in results])
    ttft_sum = prom.value(f"vllm:time_to_first_token_seconds_sum{m}")
    assert 0 < ttft_sum < prom.value(f"vllm:e2e_request_latency_seconds_sum{m}")

    for expr in VLLM_DASHBOARD_QUERIES:
        assert prom.query(expr.replace("{m}", m)), expr


def test_grafana_dashboard_queries_run(stack):
    from tests.deploy.test_grafana_dashboard import DASHBOARD, dashboard_queries
    prom, _, tiny = stack
    with openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="x", max_retries=0) as client:
        client.completions.create(model="tiny", prompt="warm", max_tokens=4, temperature=0)
    prom.wait_scraped("kvserve", time.time())
    prom.wait_for('rate(kvserve:generation_tokens_total{model_name="tiny"}[1m]) > 0')
    answered = [bool(prom.query(q)) for q in dashboard_queries(DASHBOARD, "tiny")]
    assert sum(answered) >= 0.6 * len(answered)  # spec-decode panels stay empty here


def test_kv_usage_alert_goes_pending(stack):
    prom, _, tiny = stack
    stop = threading.Event()

    def load():
        with openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="x", max_retries=0,
                           timeout=120) as client:
            while not stop.is_set():
                client.completions.create(model="tiny", prompt="fill the pool " * 4,
                                          max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True})

    # twice the requests the pool holds: one always waits to take freed blocks, so the
    # pool stays full even when a slow machine delays the clients' next requests
    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        deadline, alert = time.monotonic() + 60, None
        while time.monotonic() < deadline and alert is None:
            alerts = httpx.get(f"{prom.url}/api/v1/alerts").json()["data"]["alerts"]
            alert = next((a for a in alerts if a["labels"]["alertname"] == "KVCacheUsageHigh"
                          and a["labels"].get("model_name") == "tiny"), None)
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert alert is not None, httpx.get(f"{prom.url}/api/v1/alerts").text
    assert alert["state"] in ("pending", "firing") and alert["labels"]["severity"] == "warning"
    assert "KV cache" in alert["annotations"]["summary"]

"""`kvserve serve --replicas 2` on a real Ray: run only inside a private network namespace
(Ray binds more than loopback), by test_ray_serve.py. Not collected on its own."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.conftest import ServerProcess

A = list(range(100, 164))  # two prompt families the router tells apart
B = list(range(400, 464))


def test_the_serve_application_behind_serves_own_proxy(llama_dir, tmp_path):
    """What a RayService deploys (serve_app.build), before the module's server starts its
    own Ray."""
    assert os.environ.get("KVSERVE_TEST_NETNS") == "1", "run through test_ray_serve.py"
    import ray
    from ray import serve

    from kvserve.replicas.serve_app import build
    from tests.entrypoints.conftest import free_port

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({"argv": [llama_dir, "--replicas", "2", "--threads-per-replica", "1",
                                  "--served-model-name", "llama", "--num-threads", "1",
                                  "--state-dir", str(tmp_path)]}),
                  name="kvserve", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        body = {"prompt": A + [1] * 8, "max_tokens": 4, "temperature": 0}
        plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert plain.status_code == 200, plain.text
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert text == plain.json()["choices"][0]["text"]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'kvserve:router_requests_total{reason="cache_hit",replica="0"} 1.0' in metrics
        assert 'replica="1"' in metrics
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    assert os.environ.get("KVSERVE_TEST_NETNS") == "1", "run through test_ray_serve.py"
    log = tmp_path_factory.mktemp("ray") / "server.log"
    srv = ServerProcess(llama_dir, log, "--replicas", "2", "--served-model-name", "llama",
                        "--state-dir", str(log.parent / "state"))
    srv.wait_healthy(timeout=180)
    yield srv
    assert srv.terminate(timeout=60) == 0, srv.log()


def _complete(srv, prompt, **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 4, "temperature": 0, **kw})


def _routed(srv) -> dict[str, float]:
    return {k: v for k, v in srv.metrics().items() if k.startswith("kvserve:router_requests")}


def test_replicas_serve_and_one_prefix_stays_on_one_replica(server):
    first = _complete(server, A + [1] * 8)
    assert first.status_code == 200, first.text
    for i in range(2, 6):
        assert _complete(server, A + [i] * 8).status_code == 200
    other = _complete(server, B + [1] * 8)
    assert other.status_code == 200
    routed = _routed(server)
    assert routed == {'kvserve:router_requests_total{reason="cache_miss",replica="0"}': 1.0,
                      'kvserve:router_requests_total{reason="cache_hit",replica="0"}': 4.0,
                      'kvserve:router_requests_total{reason="cache_miss",replica="1"}': 1.0}
    metrics = server.metrics()
    assert metrics['kvserve:prefix_cache_hits_total{replica="0"}'] >= 4 * 48
    # the same greedy tokens from either replica
    again = _complete(server, B + [1] * 8)
    assert again.json()["choices"][0]["text"] == other.json()["choices"][0]["text"]
    bad = _complete(server, "x", max_tokens=-1)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def _replica_pid(index: int) -> int:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if re.search(rf"ServeReplica:[^:]+:kvserve-replica-{index}\b", cmdline):
                return int(proc.name)
    raise AssertionError(f"no process for replica {index}")


def _stream(srv, prompt, out: dict) -> None:
    body = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    out["events"] = events


def test_a_killed_replica_ends_its_requests_with_an_error_and_ray_restarts_it(server):
    dying, living = {}, {}
    threads = [threading.Thread(target=_stream, args=(server, A + [9] * 8, dying)),
               threading.Thread(target=_stream, args=(server, B + [9] * 8, living))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.metrics().get('kvserve:num_requests_running{replica="0"}', 0) < 1:
        assert time.monotonic() < deadline, "the stream never started on replica 0"
        time.sleep(0.05)
    os.kill(_replica_pid(0), signal.SIGKILL)  # as the OOM killer would
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a stream hangs after its replica died"
    assert dying["events"][-1] == "[DONE]"
    error = json.loads(dying["events"][-2])["error"]
    assert error["code"] == "replica_died", error
    assert living["events"][-1] == "[DONE]" and "error" not in living["events"][-2]
    assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in living["events"][:-1])

    assert _complete(server, A + [3] * 8).status_code == 200  # replica 1 serves meanwhile
    deadline = time.monotonic() + 120
    while server.metrics().get('kvserve:replica_up{replica="0"}') != 1.0:
        assert time.monotonic() < deadline, "Ray Serve did not bring replica 0 back"
        time.sleep(0.5)
    assert server.metrics()['kvserve:replica_failures_total{replica="0"}'] == 1.0
    assert _replica_pid(0)  # a new process
    back = _complete(server, B + [2] * 8)  # routed by load: either replica answers
    assert back.status_code == 200

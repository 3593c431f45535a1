"""``kvserve serve`` where no C compiler is found: it says so at start, in /health and in
a gauge, and serves on the torch paths."""
from __future__ import annotations

import httpx

from tests.entrypoints.conftest import ServerProcess


def test_a_server_without_a_compiler_says_it_runs_the_torch_paths(llama_dir, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))  # no cached build
    server = ServerProcess(llama_dir, tmp_path / "server.log")
    try:
        server.wait_healthy()
        kernels = httpx.get(f"{server.url}/health").json()["native_kernels"]
        assert kernels["compiled"] is False and "no C compiler" in kernels["reason"]
        assert server.metrics()["kvserve:kernels_compiled"] == 0
        done = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "count: 1 2 3", "max_tokens": 4, "temperature": 0}).json()
        assert done["choices"][0]["text"] is not None
    finally:
        server.terminate()
    start = server.log().split("kvserve is serving")[0]  # what it said before listening
    assert "slower torch paths" in start and "Install a C compiler" in start
    assert kernels["reason"] in start

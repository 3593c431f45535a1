"""Fixtures for the server tests: real `kvserve serve` processes on free loopback ports."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = "llama"  # --served-model-name of the main server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `python -m kvserve.cli serve ...` subprocess on 127.0.0.1."""

    def __init__(self, model_dir: str, log_path: Path, *extra: str) -> None:
        self.model_dir = model_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1"}
        env.pop("KVSERVE_API_KEY", None)
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--num-threads", "1",
               "--disable-access-log", *extra]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """Samples of the kvserve metrics, keyed by name plus label string (without the
        model_name and engine labels every series has)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5.0).text
        out = {}
        for m in re.finditer(r"^(kvserve:[a-z0-9_:]+)(\{[^}]*\})? ([-0-9.e+naif]+)$", text, re.M):
            pairs = [p for p in re.findall(r'[a-z_]+="[^"]*"', m.group(2) or "")
                     if not p.startswith(("model_name=", "engine="))]
            out[m.group(1) + ("{" + ",".join(pairs) + "}" if pairs else "")] = float(m.group(3))
        return out

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; kills only if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def served(model_dir: str, log_path: Path, *extra: str):
    """A healthy ServerProcess for a fixture to yield from; terminated after."""
    server = ServerProcess(model_dir, log_path, *extra)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.terminate()


@pytest.fixture(scope="session")
def server_pair(llama_dir, tmp_path_factory):
    """(main server, strict server), started together so their start-ups overlap.

    The main one is served as "llama"; the strict one under its default name (the model
    directory's basename) and has an API key, one running sequence, a waiting limit of 1 and a
    2 KiB body limit, for the 401 / 413 / 429 / SIGTERM tests.
    """
    logs = tmp_path_factory.mktemp("server_logs")
    main = ServerProcess(llama_dir, logs / "main.log", "--served-model-name", MODEL,
                         "--max-body-bytes", "1000000",
                         "--log-stats-interval", "1")
    strict = ServerProcess(llama_dir, logs / "strict.log", "--api-key", "sesame",
                           "--max-num-seqs", "1", "--max-waiting", "1",
                           "--max-body-bytes", "2048", "--shutdown-timeout", "20")
    try:
        main.wait_healthy()
        strict.wait_healthy()
        yield main, strict
    finally:
        for server in (main, strict):
            server.terminate()


@pytest.fixture(scope="session")
def server(server_pair) -> ServerProcess:
    return server_pair[0]


@pytest.fixture(scope="session")
def strict_server(server_pair) -> ServerProcess:
    return server_pair[1]


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the main server."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c

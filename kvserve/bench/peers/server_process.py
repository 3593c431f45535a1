"""``kvserve serve MODEL`` as a subprocess on a free loopback port, for the benchmarks
that measure a server (Batch API interference, replicas)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SERVED_NAME = "bench"


def server_flags(engine_args: dict) -> list[str]:
    """``kvserve serve`` flags for engine arguments (snake_case keys); a bool is a
    ``--flag`` or ``--no-flag``."""
    flags = []
    for key, value in engine_args.items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        else:
            flags.append(f"--{name}={value}")
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(server, what: str, log_path: Path, timeout_s: float, poll_s: float) -> None:
    """Return once ``server.url``'s /health answers 200; on an error, a timeout or an
    interrupt (``server.proc`` exited, or never healthy) close it and raise."""
    import httpx

    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{what} exited; see {log_path}")
            try:
                if httpx.get(f"{server.url}/health", timeout=5,
                             trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        raise RuntimeError(f"{what} did not start; see {log_path}")
    except BaseException:
        server.close()
        raise


class PeerProcess:
    """A peer's server process (``proc``) writing to ``_log``: ``signal`` pauses, resumes
    or stops it; ``close`` stops it, paused or not."""

    proc: subprocess.Popen
    _log: Any

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


class ServerProcess:
    """Started and healthy once constructed; ``close()`` stops it with SIGTERM."""

    def __init__(self, model_dir: Path, state_dir: Path, flags: list[str],
                 log_path: Path, start_timeout_s: float = 300.0) -> None:
        import httpx

        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "serve", str(model_dir),
             "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
             "--served-model-name", SERVED_NAME, "--state-dir", str(state_dir),
             "--disable-access-log", "--log-stats-interval", "0", *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self.http = httpx.Client(base_url=self.url, timeout=120, trust_env=False)
        wait_healthy(self, "the server", log_path, start_timeout_s, 0.5)

    def counter_sum(self, name: str) -> float:
        """A series summed over its labels (over the replicas, behind an ingress)."""
        text = self.http.get("/metrics").text
        pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([-0-9.e+]+)$"
        return sum(float(v) for v in re.findall(pattern, text, re.M))

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.http.close()
        self._log.close()

"""The replicas on a real Ray Serve, in a private network namespace with only loopback up
(Ray binds more than loopback). As root the namespace is a plain `unshare -n`; otherwise
a user namespace (`unshare -rn`) where the kernel allows one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.tools import require_module, require_tool

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_replicas_on_ray_serve(tmp_path):
    require_module("ray.serve", "'kvserve[ray]'")
    unshare = require_tool("unshare", "util-linux")
    ip = require_tool("ip", "iproute2")
    flags = "-n" if os.geteuid() == 0 else "-rn"
    checks = Path(__file__).with_name("ray_serve_checks.py")
    script = (f"{ip} link set lo up && exec {sys.executable} -m pytest -q -p no:cacheprovider "
              f"-m '' --basetemp {tmp_path / 'inner'} {checks}")
    env = {**os.environ, "KVSERVE_TEST_NETNS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([unshare, flags, "sh", "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=540)
    print(proc.stdout[-20000:], proc.stderr[-5000:])
    if proc.returncode != 0 and os.geteuid() != 0 and "unshare failed" in proc.stderr:
        pytest.skip(f"no private network namespace for this user: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout[-8000:]

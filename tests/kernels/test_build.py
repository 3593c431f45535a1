"""The kernels' build key follows the CPU and the compiler; without a compiler no build
is tried and the kernels say why."""
from __future__ import annotations

import logging
import os
import stat

import pytest

from kvserve.kernels import Kernels
from kvserve.kernels import build

ZEN4 = "vendor_id: AuthenticAMD\nmodel name: AMD EPYC 9654\nflags: fpu avx2 avx512f"


@pytest.fixture
def probes(monkeypatch):
    """The CPU and compiler the key sees, set by the test."""
    seen = {"cpu": ZEN4, "compiler": "cc (Debian 12.2.0-14) 12.2.0"}
    monkeypatch.setattr(build, "cpu_identity", lambda: seen["cpu"])
    monkeypatch.setattr(build, "compiler_identity", lambda compiler: seen["compiler"])
    return seen


def test_the_key_changes_with_the_cpu_flags(probes):
    before = build.build_key()
    assert build.build_key() == before  # stable for one machine
    probes["cpu"] = ZEN4.replace(" avx512f", "")  # an older CPU of the same model name
    assert build.build_key() != before


def test_the_key_changes_with_the_cpu_model(probes):
    before = build.build_key()
    probes["cpu"] = ZEN4.replace("9654", "7763")
    assert build.build_key() != before


def test_the_key_changes_with_the_compiler_version(probes):
    before = build.build_key()
    probes["compiler"] = "cc (Debian 14.2.0-19) 14.2.0"
    assert build.build_key() != before


def test_the_key_changes_with_the_flags(probes):
    assert build.build_key(("-mno-avx512f",)) != build.build_key()


def test_cpu_identity_names_the_model_and_its_flags():
    identity = build.cpu_identity()
    assert identity
    if os.path.exists("/proc/cpuinfo"):
        cpuinfo = open("/proc/cpuinfo").read()
        for field in ("model name", "flags", "Features"):
            if f"\n{field}\t" in cpuinfo:
                assert f"{field}: " in identity


def test_compiler_identity_is_its_version_line(tmp_path):
    fake = tmp_path / "fakecc"
    fake.write_text("#!/bin/sh\necho 'fakecc 9.9.9'\necho more\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert build.compiler_identity(str(fake)) == "fakecc 9.9.9"
    assert build.compiler_identity(None) == build.NO_COMPILER


def test_without_a_compiler_the_kernels_say_what_is_missing(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    logger = logging.getLogger("kvserve.kernels")  # kvserve's loggers do not propagate
    logger.addHandler(caplog.handler)
    try:
        kernels = Kernels()
    finally:
        logger.removeHandler(caplog.handler)
    assert not kernels.available
    assert kernels.reason.startswith("no C compiler") and "no-such-cc" in kernels.reason
    assert not (tmp_path / "cache").exists()  # nothing was tried
    assert "slower torch paths" in caplog.text and kernels.reason in caplog.text

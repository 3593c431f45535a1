"""Finding the external programs that the deploy tests drive (promtool, prometheus, ...)."""
from __future__ import annotations

import importlib
import os
import shutil

import pytest


def require_tool(name: str, debian_package: str) -> str:
    """The path of program ``name``. If it is missing, fail when running as root (a CI
    or dev container that should have installed it), and skip otherwise (a user who
    may not be able to install packages)."""
    path = shutil.which(name)
    if path:
        return path
    reason = f"{name} not found: apt-get install {debian_package}"
    if os.geteuid() == 0:
        pytest.fail(reason)
    pytest.skip(reason)


def require_module(name: str, pip_name: str):
    """Import ``name``; if it is missing, fail as root and skip otherwise, as above."""
    try:
        return importlib.import_module(name)
    except ImportError:
        reason = f"{name} not importable: pip install {pip_name}"
        if os.geteuid() == 0:
            pytest.fail(reason)
        pytest.skip(reason)

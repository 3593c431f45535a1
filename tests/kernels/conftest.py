"""The kernels' builds a test may run on: this CPU's own (native), AVX2 on an AVX-512
machine, and plain C (no vector extensions)."""
from __future__ import annotations

import pytest

from kvserve.kernels import Kernels, load_kernels
from tests.helpers import KERNEL_BUILD_FLAGS as BUILD_FLAGS


@pytest.fixture(scope="module", params=["native", "avx2", "plain-c"])
def build(request):
    if request.param == "native":
        return load_kernels()
    built = Kernels(BUILD_FLAGS[request.param])
    assert built.available, built.reason
    return built

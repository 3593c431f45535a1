"""The native int8 matmul: torch._int_mm's exact int32 sums, for CPUs without VNNI."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels import load_kernels


@pytest.mark.parametrize("m, k, n", [(1, 2048, 64), (3, 100, 37), (8, 256, 16), (17, 64, 5)])
def test_int8_matmul_sums_exactly(m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    assert torch.equal(load_kernels().int8_matmul(x, w).long(), x.long() @ w.long().t())


def test_the_extremes_do_not_saturate():
    x = torch.full((4, 4096), -128, dtype=torch.int8)
    w = torch.full((3, 4096), -128, dtype=torch.int8)
    assert torch.equal(load_kernels().int8_matmul(x, w), torch.full((4, 3), 4096 * 16384,
                                                                     dtype=torch.int32))


def test_int8_matmul_refuses_other_inputs():
    with pytest.raises(ValueError, match="contiguous int8"):
        load_kernels().int8_matmul(torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.int8))

"""int8 weights in runs of eight rows (int8_runs.c): torch._int_mm's exact int32 sums on
the AVX-512 VNNI build, and no runs on a build without it."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels.build import cpu_has_any


def _has_runs(build, request) -> bool:
    """Whether this build multiplies runs: the native build on a CPU with AVX-512 VNNI."""
    return request.node.callspec.params["build"] == "native" and cpu_has_any("avx512_vnni")


def _exact(x, w):
    return x.long() @ w.long().t()


@pytest.mark.parametrize("m, k, n", [(1, 2048, 64), (3, 104, 37), (8, 256, 16), (17, 64, 5),
                                     (16, 8192, 24), (300, 2048, 24), (77, 8192, 40)])
def test_runs_sum_exactly(build, request, m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    packed = build.int8_pack_runs(w)
    if not _has_runs(build, request):
        assert packed is None
        return
    runs, row_sums = packed
    assert runs.shape == (-(-n // 8) * 8, k)
    assert torch.equal(row_sums.long(), w.long().sum(1))
    assert torch.equal(build.int8_runs_matmul(x, runs, row_sums).long(), _exact(x, w))


def test_runs_extremes_do_not_overflow(build, request):
    """The largest sums a lane takes (x + 128 = 255 against -128, over the longest rows)
    and the largest result stay exact."""
    k = 16384
    x = torch.full((3, k), 127, dtype=torch.int8)
    x[1] = -128
    w = torch.full((9, k), -128, dtype=torch.int8)
    w[4] = 127
    packed = build.int8_pack_runs(w)
    if not _has_runs(build, request):
        assert packed is None
        return
    assert torch.equal(build.int8_runs_matmul(x, *packed).long(), _exact(x, w))


def test_runs_refuse_rows_they_cannot_hold(build, request):
    """Columns not a multiple of 8, or past the length whose sums stay in int32: no runs
    (the plain weight stays)."""
    for k in (100, 16392):
        assert build.int8_pack_runs(torch.zeros(8, k, dtype=torch.int8)) is None


def test_runs_matmul_refuses_mismatched_inputs():
    from kvserve.kernels import load_kernels
    kernels = load_kernels()
    w = torch.zeros(8, 64, dtype=torch.int8)
    packed = kernels.int8_pack_runs(w)
    if packed is None:
        pytest.skip("this CPU has no AVX-512 VNNI: no runs to multiply")
    with pytest.raises(ValueError, match="int8_pack_runs made"):
        kernels.int8_runs_matmul(torch.zeros(2, 32, dtype=torch.int8), *packed)

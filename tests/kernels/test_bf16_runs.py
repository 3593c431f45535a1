"""bfloat16 weights in runs of sixteen rows (bf16_runs.c): float32 sums of exact bf16
products, rounded to bfloat16 once, on the AVX512-BF16 build; no runs on a build
without it."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels.build import cpu_has_any


def _has_runs(request) -> bool:
    return request.node.callspec.params["build"] == "native" and cpu_has_any("avx512_bf16")


def _bf16(*shape, gen):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("m, k, n", [(1, 2048, 64), (3, 100, 37), (9, 256, 40), (16, 512, 33),
                                     (8, 2, 17), (150, 64, 48)])  # 150: three blocks of x
@pytest.mark.parametrize("bias", [False, True])
def test_runs_round_the_float32_sums_once(build, request, m, k, n, bias):
    gen = torch.Generator().manual_seed(m * 100 + k + n)
    x, w = _bf16(m, k, gen=gen), _bf16(n, k, gen=gen)
    b = torch.randn(n, generator=gen) if bias else None
    runs = build.bf16_pack_runs(w)
    if not _has_runs(request):
        assert runs is None
        return
    assert runs.shape == (-(-n // 16) * 16, k)
    got = build.bf16_runs_matmul(x, runs, n, b)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    # float32 sums of exact products: off by float32 rounding, then one bf16 rounding
    err = (got.double() - exact).abs()
    bound = exact.abs() * 2**-8 + (x.double().abs() @ w.double().abs().t()) * k * 2**-23
    assert (err <= bound).all()


def test_a_row_gets_the_same_bits_whatever_rows_run_beside_it(build, request):
    gen = torch.Generator().manual_seed(7)
    x, w = _bf16(77, 384, gen=gen), _bf16(70, 384, gen=gen)
    runs = build.bf16_pack_runs(w)
    if not _has_runs(request):
        pytest.skip("no AVX512-BF16 in this build: no runs")
    together = build.bf16_runs_matmul(x, runs, 70)
    for r in (0, 8, 12, 70, 76):  # 64 on: the second block of x
        assert torch.equal(build.bf16_runs_matmul(x[r:r + 1].contiguous(), runs, 70),
                           together[r:r + 1])


def test_odd_rows_have_no_runs(build):
    assert build.bf16_pack_runs(torch.zeros(16, 7, dtype=torch.bfloat16)) is None


def test_runs_matmul_refuses_mismatched_inputs():
    from kvserve.kernels import load_kernels
    kernels = load_kernels()
    runs = kernels.bf16_pack_runs(torch.zeros(16, 64, dtype=torch.bfloat16))
    if runs is None:
        pytest.skip("this CPU has no AVX512-BF16: no runs to multiply")
    with pytest.raises(ValueError, match="bf16_pack_runs made"):
        kernels.bf16_runs_matmul(torch.zeros(2, 32, dtype=torch.bfloat16), runs, 16)

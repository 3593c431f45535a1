"""The 4-bit kernels (int4_linear.c) on their native, AVX2 and plain-C builds: the few-row
products against the float64 product of the torch dequantization, symmetric and
asymmetric groups, every row count the kernel takes, output columns written into a
wider matrix; the tile dequantization bit for bit; what they refuse."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels import load_kernels
from kvserve.model.compressed.linear import dequantize_int4, pack_codes, unpack_codes

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")


def int4_weight(n: int, k: int, group: int, symmetric: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    zeros = (torch.full((n, k // group), 8) if symmetric
             else torch.randint(0, 16, (n, k // group), generator=g)).to(torch.int8)
    return pack_codes(codes), scales, zeros


def test_packing_round_trips():
    codes = torch.randint(0, 16, (5, 96), generator=torch.Generator().manual_seed(0))
    packed = pack_codes(codes)
    assert packed.shape == (5, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed).long(), codes)
    # byte i of a run holds value i (low nibble) and value i + 16 (high nibble)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 16] << 4)


@pytest.mark.parametrize("group, symmetric", [(32, True), (128, False), (768, False)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_few_rows_equal_dequantize_then_multiply(build, rows, group, symmetric):
    n, k = 37, 768  # an odd column count: the threads' shares are uneven
    codes, scales, zeros = int4_weight(n, k, group, symmetric, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ dequantize_int4(codes, scales, zeros).double().t()
    wide = torch.full((rows, n + 11), 7.0)
    build.int4_rows(x, codes, scales, zeros, group, wide[:, 5:5 + n])
    got = wide[:, 5:5 + n]
    assert ((got.double() - want).abs().max() / want.abs().max()) < 2e-6
    assert (wide[:, :5] == 7.0).all() and (wide[:, 5 + n:] == 7.0).all()


@pytest.mark.parametrize("symmetric", [True, False])
def test_tile_dequantization_is_the_torch_one_bit_for_bit(build, symmetric):
    codes, scales, zeros = int4_weight(9, 512, 128, symmetric, seed=3)
    want = dequantize_int4(codes, scales, zeros)
    assert torch.equal(build.int4_dequantize(codes, scales, zeros, 128), want)
    # (q - z) * s itself, as compressed-tensors dequantizes
    q = unpack_codes(codes).float()
    assert torch.equal(want, (q - zeros.float().repeat_interleave(128, 1))
                       * scales.repeat_interleave(128, 1))


def test_refused_shapes_are_named():
    codes, scales, zeros = int4_weight(4, 64, 32, True, seed=0)
    with pytest.raises(ValueError, match="1-8 rows, groups of whole 32s"):
        kernels.int4_rows(torch.randn(9, 64), codes, scales, zeros, 32, torch.empty(9, 4))
    with pytest.raises(ValueError, match="1-8 rows, groups of whole 32s"):
        kernels.int4_rows(torch.randn(2, 64), codes, scales, zeros, 48, torch.empty(2, 4))
    with pytest.raises(ValueError, match="contiguous float32 x"):
        kernels.int4_rows(torch.randn(2, 64).double(), codes, scales, zeros, 32,
                          torch.empty(2, 4))
    with pytest.raises(ValueError, match="does not divide"):
        kernels.int4_dequantize(codes, scales, zeros, 48)

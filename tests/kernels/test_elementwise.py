"""The native RMSNorm, SiLU-and-multiply and rotary kernels agree with the torch paths."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels import Kernels, load_kernels
from kvserve.model.config import RopeConfig
from kvserve.model.execution import ExecutionMode, configure_layers
from kvserve.model.layers import GatedActivation, RMSNorm
from kvserve.model.rotary import RotaryEmbedding

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")


def configure_native(layer, kernels) -> int:
    """How many of the layer's modules took the native kernels."""
    configure_layers(layer, ExecutionMode(kernels=kernels))
    return sum(getattr(m, "native", None) is kernels for m in layer.modules())


@pytest.mark.parametrize("rows, dim", [(1, 64), (5, 100), (33, 768)])
def test_rms_norm(rows, dim):
    torch.manual_seed(0)
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data.normal_()
    x = torch.randn(rows, dim) * 3
    expected = norm(x)
    assert configure_native(norm, kernels) == 1
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows, dim", [(1, 64), (5, 100), (33, 768)])
def test_add_rms_norm_is_add_then_norm(rows, dim, dtype):
    """The fused residual add + norm returns the bits of torch's add followed by the
    unfused norm (native or torch), and leaves the sum in the residual."""
    torch.manual_seed(0)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data.normal_()
    x, residual = (torch.randn(rows, dim) * 3).to(dtype), torch.randn(rows, dim).to(dtype)
    total = residual + x
    torch_normed, torch_sum = norm(x, residual.clone())
    assert torch.equal(torch_sum, total) and torch.equal(torch_normed, norm(total))
    assert configure_native(norm, kernels) == 1
    fused_residual = residual.clone()
    normed, out_sum = norm(x, fused_residual)
    assert out_sum is fused_residual and torch.equal(fused_residual, total)
    assert torch.equal(normed, norm(total))


@pytest.mark.parametrize("rows, inter", [(1, 16), (2, 24), (4, 37), (9, 2048)])
def test_silu_mul(rows, inter):
    torch.manual_seed(0)
    act = GatedActivation("silu")
    gate_up = torch.randn(rows, 2 * inter) * 6  # reaches exp's clamped and tiny ranges
    gate_up[0, 0], gate_up[0, 1] = 95.0, -95.0
    expected = act(gate_up)
    assert configure_native(act, kernels) == 1
    native = act(gate_up)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)
    # the AVX-512 loop (where the machine has it) gives the AVX2 loop's bits
    assert torch.equal(Kernels(("-mno-avx512f",)).silu_mul(gate_up), native)


def test_gelu_gate_stays_on_torch():
    assert configure_native(GatedActivation("gelu"), kernels) == 0


@pytest.mark.parametrize("num_q, num_k, head_dim", [(4, 2, 16), (12, 4, 64), (3, 3, 10)])
def test_rotary_in_place_on_fused_qkv(num_q, num_k, head_dim):
    torch.manual_seed(0)
    rope = RotaryEmbedding(RopeConfig(), head_dim, 256)
    t, kv = 7, num_k * head_dim
    qkv = torch.randn(t, num_q * head_dim + 2 * kv)
    positions = torch.tensor([0, 1, 2, 100, 101, 5, 255])
    q, k, v = qkv.split([num_q * head_dim, kv, kv], dim=-1)
    eq, ek = rope(positions, q.reshape(t, num_q, head_dim), k.reshape(t, num_k, head_dim))
    v_before = v.clone()
    assert not rope.rotate_qkv_(positions, qkv, num_q, num_k, head_dim)  # not enabled yet
    assert configure_native(rope, kernels) == 1
    assert rope.rotate_qkv_(positions, qkv, num_q, num_k, head_dim)
    q, k, v = qkv.split([num_q * head_dim, kv, kv], dim=-1)
    torch.testing.assert_close(q.reshape(t, num_q, head_dim), eq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.reshape(t, num_k, head_dim), ek, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_before)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between two bf16 tensors in units in the last place."""
    ia, ib = (t.view(torch.int16).to(torch.int32) for t in (a, b))
    ia = torch.where(ia < 0, -32768 - ia, ia)  # sign-magnitude -> ordered integers
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max())


def test_bfloat16_rms_norm_and_rotary_match_torch():
    """bf16 activations: the native passes round where torch's bf16 ops round, so they
    agree with the torch path to within one bf16 step (float32 sums in another order)."""
    torch.manual_seed(0)
    norm = RMSNorm(768, 1e-5).to(torch.bfloat16)
    norm.weight.data.normal_()
    x = (torch.randn(33, 768) * 3).to(torch.bfloat16)
    rope = RotaryEmbedding(RopeConfig(), 64, 256).to(torch.bfloat16)
    qkv = torch.randn(7, 16 * 64).to(torch.bfloat16)
    positions = torch.tensor([0, 1, 2, 100, 101, 5, 255])
    q, k, _ = qkv.split([12 * 64, 2 * 64, 2 * 64], dim=-1)
    eq, ek = rope(positions, q.reshape(7, 12, 64), k.reshape(7, 2, 64))
    expected = norm(x)
    assert configure_native(norm, kernels) + configure_native(rope, kernels) == 2
    got = norm(x)
    assert rope.rotate_qkv_(positions, qkv, 12, 2, 64)
    q, k, _ = qkv.split([12 * 64, 2 * 64, 2 * 64], dim=-1)
    assert got.dtype == torch.bfloat16 and _bf16_ulps(got, expected) <= 1
    assert _bf16_ulps(q.reshape(7, 12, 64), eq) <= 1
    assert _bf16_ulps(k.reshape(7, 2, 64), ek) <= 1

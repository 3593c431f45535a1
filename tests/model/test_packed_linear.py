"""Linear on oneDNN with a packed weight agrees with F.linear; the engine packs its layers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.execution import ExecutionMode, configure_layers
from kvserve.model.layers import Linear
from kvserve.model.linear_method import packed_linear_available

PACKED = ExecutionMode(packed_linear=True)
PADDED_6 = ExecutionMode(packed_linear=True, linear_min_rows=6)

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="torch without oneDNN")


@pytest.mark.parametrize("rows, bias", [(1, False), (7, True), (300, True)])
def test_packed_matches_torch(rows, bias):
    torch.manual_seed(0)
    layer = Linear(72, 130, bias=bias)
    x = torch.randn(rows, 72)
    expected = F.linear(x, layer.weight, layer.bias)
    exact = F.linear(x.double(), layer.weight.double(),
                     None if layer.bias is None else layer.bias.double())
    assert configure_layers(layer, PACKED) == 1 and layer.method.packed_weight is not None
    got = layer(x)
    # float32 rounding only: no worse than torch's own error against float64, plus slack
    bound = 2 * (expected.double() - exact).abs().max().item() + 1e-6
    assert (got.double() - exact).abs().max().item() <= bound


def test_engine_packs_linears_unless_torch_backend(llama_dir):
    from kvserve import LLM
    linears = lambda llm: [m for m in llm.engine.worker.runner.model.modules() if isinstance(m, Linear)]
    packed = linears(LLM(llama_dir))
    plain = linears(LLM(llama_dir, attention_backend="torch"))
    assert packed and all(m.method.packed_weight is not None for m in packed)
    assert plain and all(m.method.packed_weight is None for m in plain)


def test_padded_rows_are_the_rows_of_the_larger_gemm():
    """A GEMM of fewer than min_rows rows runs at min_rows rows: the real rows come out
    bit-identical to the same rows of a min_rows GEMM whatever the other rows hold."""
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True)
    layer.configure(PACKED)
    x = torch.randn(6, 96)
    full = layer(x)                                   # 6 rows: no padding either way
    layer.configure(PADDED_6)
    layer(torch.randn(5, 96) * 1e6)                   # leaves other values in the padding
    for rows in (1, 2, 5):
        got = layer(x[:rows])
        assert got.shape == (rows, 200)
        other = torch.cat([x[:rows], torch.randn(6 - rows, 96)])
        layer.configure(PACKED)
        assert torch.equal(got, layer(other)[:rows])
        layer.configure(PADDED_6)
    assert torch.equal(layer(x), full)                # at min_rows and above: unchanged
    assert layer(torch.randn(9, 96)).shape == (9, 200)


def test_configure_unpacks_and_keeps_one_packed_copy():
    """Configured again, a layer keeps its packed weight (no second copy) or drops it."""
    layer = Linear(32, 48)
    layer.configure(PACKED)
    packed = layer.method.packed_weight
    layer.configure(PADDED_6)
    assert layer.method.packed_weight is packed and layer.method.min_rows == 6
    layer.configure(ExecutionMode(linear_min_rows=6))  # not packed: never padded
    assert layer.method.packed_weight is None and layer.method.min_rows == 1
    x = torch.randn(3, 32)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_bf16_decode_rows_take_the_runs_and_the_dense_weight_can_go():
    """A bfloat16 layer on the packed path keeps runs of rows where the kernels have
    them: steps of up to runs_max_rows rows take them (no oneDNN call), longer ones the
    packed GEMM; the dense weight can be let go and comes back the same."""
    from kvserve.kernels import load_kernels
    from kvserve.model.linear_method import BF16_RUNS_MAX_ROWS, packed_bf16_available
    kernels = load_kernels()
    if not (packed_bf16_available() and kernels.available):
        pytest.skip("no hardware bf16 GEMM here: bfloat16 layers are not packed")
    torch.manual_seed(2)
    layer = Linear(96, 40, bias=True).to(torch.bfloat16)
    dense = layer.weight.detach().clone()
    configure_layers(layer, ExecutionMode(packed_linear=True, kernels=kernels))
    if kernels.bf16_pack_runs(dense) is None:
        assert layer.method.runs_max_rows == 0 and not hasattr(layer, "weight_runs")
        pytest.skip("this CPU has no AVX512-BF16: no runs")
    assert layer.method.runs_max_rows == BF16_RUNS_MAX_ROWS
    assert layer.method.release_dense_weight(layer) == dense.numel() * 2
    assert layer.weight.is_meta
    for rows in (1, 5, BF16_RUNS_MAX_ROWS, BF16_RUNS_MAX_ROWS + 1):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        exact = x.double() @ dense.double().t() + layer.bias.double()
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-3).all(), rows
    layer.method.restore_dense_weight(layer)
    assert torch.equal(layer.weight, dense)
    configure_layers(layer, ExecutionMode(packed_linear=True, kernels=None))
    assert layer.method.runs_max_rows == 0 and not hasattr(layer, "weight_runs")

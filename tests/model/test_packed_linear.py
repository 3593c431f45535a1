"""Linear on oneDNN with a packed weight agrees with F.linear; the engine packs its layers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.layers import Linear, packed_linear_available, use_packed_linear

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="torch without oneDNN")


@pytest.mark.parametrize("rows, bias", [(1, False), (7, True), (300, True)])
def test_packed_matches_torch(rows, bias):
    torch.manual_seed(0)
    layer = Linear(72, 130, bias=bias)
    x = torch.randn(rows, 72)
    expected = F.linear(x, layer.weight, layer.bias)
    exact = F.linear(x.double(), layer.weight.double(),
                     None if layer.bias is None else layer.bias.double())
    assert use_packed_linear(layer) == 1 and layer.packed_weight is not None
    got = layer(x)
    # float32 rounding only: no worse than torch's own error against float64, plus slack
    bound = 2 * (expected.double() - exact).abs().max().item() + 1e-6
    assert (got.double() - exact).abs().max().item() <= bound


def test_engine_packs_linears_unless_torch_backend(llama_dir):
    from kvserve import LLM
    linears = lambda llm: [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    packed = linears(LLM(llama_dir))
    plain = linears(LLM(llama_dir, attention_backend="torch"))
    assert packed and all(m.packed_weight is not None for m in packed)
    assert plain and all(m.packed_weight is None for m in plain)


def test_padded_rows_are_the_rows_of_the_larger_gemm():
    """A GEMM of fewer than min_rows rows runs at min_rows rows: the real rows come out
    bit-identical to the same rows of a min_rows GEMM whatever the other rows hold."""
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True)
    use_packed_linear(layer)
    x = torch.randn(6, 96)
    full = layer(x)                                   # 6 rows: no padding either way
    layer.min_rows = 6
    layer(torch.randn(5, 96) * 1e6)                   # leaves other values in the padding
    for rows in (1, 2, 5):
        got = layer(x[:rows])
        assert got.shape == (rows, 200)
        other = torch.cat([x[:rows], torch.randn(6 - rows, 96)])
        layer.min_rows = 1
        assert torch.equal(got, layer(other)[:rows])
        layer.min_rows = 6
    assert torch.equal(layer(x), full)                # at min_rows and above: unchanged
    assert layer(torch.randn(9, 96)).shape == (9, 200)

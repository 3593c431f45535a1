"""The native few-row linear agrees with torch's, and the engine routes decode steps to it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import load_kernels
from kvserve.model.layers import Linear, use_fast_linear

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")


@pytest.mark.parametrize("m, n, k, bias", [
    (1, 64, 32, False), (3, 130, 72, True), (7, 5, 13, True), (32, 256, 768, False),
    (1, 1, 1, True)])
def test_matches_torch(m, n, k, bias):
    torch.manual_seed(0)
    x, w = torch.randn(m, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    ours, torchs = kernels.few_rows_linear(x, w, b), F.linear(x, w, b)
    # float32 rounding only: no worse than torch's own error against float64, plus slack
    bound = 2 * (torchs.double() - exact).abs().max().item() + 1e-5
    assert (ours.double() - exact).abs().max().item() <= bound


def test_linear_uses_native_only_for_few_rows(monkeypatch):
    layer = Linear(16, 8)
    assert use_fast_linear(layer, kernels) == 1
    calls = []
    monkeypatch.setattr(kernels, "few_rows_linear",
                        lambda x, w, b: calls.append(x.shape[0]) or F.linear(x, w, b))
    layer(torch.randn(kernels.few_rows_max, 16))
    layer(torch.randn(kernels.few_rows_max + 1, 16))
    assert calls == [kernels.few_rows_max]


def test_engine_routes_linears(llama_dir):
    from kvserve import LLM
    native = LLM(llama_dir)
    plain = LLM(llama_dir, attention_backend="torch")
    linears = lambda llm: [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears(native) and all(m.native is kernels for m in linears(native))
    assert all(m.native is None for m in linears(plain))

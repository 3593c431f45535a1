"""Each Linear computes through its one method object: forward hands the method flat,
non-empty rows; configure reaches the method; a method swapped in is what runs."""
from __future__ import annotations

import torch

from kvserve.model.execution import ExecutionMode, configure_layers
from kvserve.model.layers import Linear
from kvserve.model.linear_method import FloatLinearMethod, LinearMethod


class Recording(LinearMethod):
    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.modes: list[ExecutionMode] = []

    def configure(self, layer, mode) -> None:
        self.modes.append(mode)

    def apply(self, layer, x):
        self.shapes.append(tuple(x.shape))
        return torch.full((x.shape[0], layer.out_features), 7.0)


def test_every_linear_starts_with_its_own_float_method():
    a, b = Linear(4, 8), Linear(4, 8)
    assert isinstance(a.method, FloatLinearMethod) and a.method is not b.method
    x = torch.randn(3, 4)
    torch.testing.assert_close(a(x), torch.nn.functional.linear(x, a.weight, a.bias))


def test_the_method_gets_flat_rows_and_the_mode():
    layer = Linear(4, 8)
    layer.method = method = Recording()
    mode = ExecutionMode()
    assert configure_layers(layer, mode) == 1 and method.modes == [mode]
    out = layer(torch.randn(2, 3, 4))
    assert out.shape == (2, 3, 8) and bool((out == 7).all())
    assert layer(torch.randn(0, 4)).shape == (0, 8)  # no rows: the method is not called
    assert method.shapes == [(6, 4)]


def test_the_float_method_lets_the_dense_weight_go_only_where_panels_serve():
    layer = Linear(16, 32)
    method = layer.method
    dense = layer.weight.detach().clone()
    assert method.release_dense_weight(layer) == 0  # no panels: the dense weight is read
    method.panel_weight = dense.reshape(32 // 16, 16, 16).transpose(1, 2).contiguous()
    assert method.release_dense_weight(layer) == dense.numel() * 4 and layer.weight.is_meta
    method.restore_dense_weight(layer)
    assert torch.equal(layer.weight, dense)

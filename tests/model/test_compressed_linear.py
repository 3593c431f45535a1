"""The W4A16 linear method (kvserve/model/compressed/linear.py): a fused layer loaded a part
at a time, computed on few rows (the native kernel), on many (dequantized tiles) and
without kernels, against its dequantized float weight; the rows of a part that does not
fit are refused."""
from __future__ import annotations

import pytest
import torch

from kvserve.model.compressed.linear import TILE_ROWS, Int4LinearMethod, Int4Weight, \
    dequantize_int4
from kvserve.model.layers import Linear
from tests.helpers import assert_layer_computes
from tests.kernels.test_int4_linear_kernel import int4_weight

K, GROUP = 256, 64
PARTS = [(48, True), (TILE_ROWS + 16, False)]  # (rows, symmetric): two parts of a fused layer


def fused_layer(bias: bool) -> tuple[Linear, torch.Tensor]:
    with torch.device("meta"):
        layer = Linear(K, sum(rows for rows, _ in PARTS), bias=bias)
    method = Int4LinearMethod.install(layer, GROUP)
    layer.to_empty(device="cpu")
    if bias:
        layer.bias.data.normal_()
    first, dense = 0, []
    for i, (rows, symmetric) in enumerate(PARTS):
        part = Int4Weight(*int4_weight(rows, K, GROUP, symmetric, seed=i))
        method.load(layer, first, part)
        dense.append(dequantize_int4(part.codes, part.scales, part.zeros))
        first += rows
    assert layer.weight is None and layer.codes.shape == (first, K // 2)
    return layer, torch.cat(dense)


@pytest.mark.parametrize("rows", [1, 8, 9, 40])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_a_fused_layer_computes_its_dequantized_weight(rows, native, bias):
    layer, dense = fused_layer(bias)
    assert_layer_computes(layer, dense, rows, native)


def test_a_part_that_does_not_fit_is_refused():
    with torch.device("meta"):
        layer = Linear(K, 64, bias=False)
    method = Int4LinearMethod.install(layer, GROUP)
    layer.to_empty(device="cpu")
    with pytest.raises(ValueError, match="does not fit rows 32:96"):
        method.load(layer, 32, Int4Weight(*int4_weight(64, K, GROUP, True, seed=0)))
    with pytest.raises(ValueError, match="groups must be whole multiples of 32"):
        with torch.device("meta"):
            Int4LinearMethod.install(Linear(K, 64, bias=False), 48)


def act_order_layer(perms: list[torch.Tensor]) -> tuple[Linear, torch.Tensor]:
    """A fused layer of one part per perm, its columns in each part's order (an act-order
    GPTQ weight as Int4Weight holds it), and its float weight in the input's order."""
    with torch.device("meta"):
        layer = Linear(K, 32 * len(perms), bias=False)
    method = Int4LinearMethod.install(layer, GROUP, act_order=True)
    layer.to_empty(device="cpu")
    dense = []
    for i, perm in enumerate(perms):
        part = Int4Weight(*int4_weight(32, K, GROUP, False, seed=i), perm=perm)
        method.load(layer, 32 * i, part)
        gathered = dequantize_int4(part.codes, part.scales, part.zeros)
        dense.append(torch.empty_like(gathered).index_copy_(1, perm, gathered))
    return layer, torch.cat(dense)


@pytest.mark.parametrize("rows", [1, 9])
@pytest.mark.parametrize("native", [True, False])
def test_act_order_columns_are_gathered_from_the_input(rows, native):
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(3))
    layer, dense = act_order_layer([perm, perm])
    assert_layer_computes(layer, dense, rows, native)


def test_act_order_in_the_input_order_costs_nothing():
    layer, dense = act_order_layer([torch.arange(K)])
    assert_layer_computes(layer, dense, 2, native=False)
    assert layer.perm is None  # dropped when configured


def test_parts_of_a_fused_layer_in_different_column_orders_are_refused():
    g = torch.Generator().manual_seed(4)
    with pytest.raises(ValueError, match="order their input columns differently"):
        act_order_layer([torch.randperm(K, generator=g), torch.randperm(K, generator=g)])

"""The linear method on GGUF blocks (kvserve/model/gguf/linear.py): a fused layer whose
parts come in different formats (as a Q4_K_M file's q, k and v do) and in float,
computed on few rows (the native kernel), on many (dequantized tiles) and without
kernels, against the layer's dequantized float weight (with float activations: the int8
ones are the kernel tests'); a prompt chunk with int8 activations row for row as decode
steps; the rows a llama file permutes."""
from __future__ import annotations

import pytest
import torch

from kvserve.model.gguf.linear import TILE_ROWS, BlockWeight, GGUFLinearMethod
from kvserve.model.gguf.quants import BLOCKS, random_blocks
from kvserve.model.layers import Linear
from tests.helpers import assert_layer_computes

PARTS = [("Q4_K", 64), ("Q6_K", 32), ("float", 32), ("Q8_0", TILE_ROWS + 16), ("Q5_K", 32)]
K = 512


def fused_layer(bias: bool) -> tuple[Linear, torch.Tensor]:
    """A layer of PARTS and its float weight (the dequantized parts, stacked)."""
    with torch.device("meta"):
        layer = Linear(K, sum(rows for _, rows in PARTS), bias=bias)
    method = GGUFLinearMethod.install(layer, [rows for _, rows in PARTS])
    method.int8_activations = False  # the float sums: dequantize-then-multiply's
    layer.to_empty(device="cpu")
    if bias:
        layer.bias.data.normal_()
    dense = []
    for i, (kind, rows) in enumerate(PARTS):
        if kind == "float":
            part = torch.randn(rows, K)
            dense.append(part)
        else:
            part = BlockWeight(kind, torch.from_numpy(random_blocks(
                kind, rows * K // BLOCKS[kind][0], seed=i)).reshape(rows, -1), K)
            dense.append(part.dequantize())
        method.load(layer, i, part)
    assert layer.weight is None and not method.missing_parts()
    return layer, torch.cat(dense)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_a_fused_layer_of_mixed_formats_computes_its_float_weight(rows, native, bias):
    layer, dense = fused_layer(bias)
    assert_layer_computes(layer, dense, rows, native)


def test_a_prompt_chunk_rounds_its_rows_as_decode_steps_do():
    """With int8 activations a prompt chunk (more rows than a decode step) is computed on
    the blocks as decode rows are, each row's outputs bit for bit those of a step of eight
    rows; with float ones, on dequantized tiles."""
    from kvserve.kernels import load_kernels
    from kvserve.model.execution import ExecutionMode
    kernels = load_kernels()
    if not kernels.available:
        pytest.fail(f"the native kernels did not build: {kernels.reason}")
    layer, dense = fused_layer(bias=True)
    layer.method.int8_activations = True
    layer.configure(ExecutionMode(kernels=kernels))
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(3))
    chunk = layer(x)
    assert torch.equal(chunk, torch.cat([layer(x[r:r + 8]) for r in range(0, 40, 8)]))
    floats = torch.nn.functional.linear(x.double(), dense.double(), layer.bias.double())
    error = (chunk.double() - floats).abs().max() / floats.abs().max()
    assert 1e-5 < error < 2e-2  # rounded, and only by the rounding
    layer.method.int8_activations = False
    error = (layer(x).double() - floats).abs().max() / floats.abs().max()
    assert error < 2e-6


def test_a_part_of_another_shape_is_refused():
    with torch.device("meta"):
        layer = Linear(K, 64, bias=False)
    method = GGUFLinearMethod.install(layer, [32, 32])
    wrong = BlockWeight("Q8_0", torch.from_numpy(random_blocks("Q8_0", 48 * K // 32, 0))
                        .reshape(48, -1), K)
    with pytest.raises(ValueError, match=r"shape \(48, 512\) does not fit part 1 \(32, 512\)"):
        method.load(layer, 1, wrong)
    assert method.missing_parts() == [0, 1]


def test_permuted_rows_move_whole_rows():
    blocks = torch.from_numpy(random_blocks("Q4_K", 8 * 2, 1)).reshape(8, -1)
    weight = BlockWeight("Q4_K", blocks, 512)
    order = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])
    assert torch.equal(weight.permute_rows(order).dequantize(), weight.dequantize()[order])


def test_parts_run_as_runs_of_rows_with_the_kernels_and_go_back_without():
    from kvserve.kernels import load_kernels
    from kvserve.model.execution import ExecutionMode
    kernels = load_kernels()
    if not kernels.available:
        pytest.fail(f"the native kernels did not build: {kernels.reason}")
    layer, dense = fused_layer(bias=False)
    file_bytes = [layer.gguf_part0.clone(), layer.gguf_part1.clone(), None,
                  layer.gguf_part3.clone()]
    layer.configure(ExecutionMode(kernels=kernels))
    assert layer.method.kinds == ["Q4_K_X4", "Q6_K_X4", "float", "Q8_0_X8", "Q5_K_X4"]
    assert layer.gguf_part0.shape == (64, 2 * 148) and layer.gguf_part4.shape == (32, 2 * 180)
    for i in (1, 3):  # Q6_K's and Q8_0's runs: the same size
        assert not torch.equal(getattr(layer, f"gguf_part{i}"), file_bytes[i])
    assert_layer_computes(layer, dense, 2, native=True)
    layer.configure(ExecutionMode(kernels=None))
    assert layer.method.kinds == ["Q4_K", "Q6_K", "float", "Q8_0", "Q5_K"]
    for i in (0, 1, 3):
        assert torch.equal(getattr(layer, f"gguf_part{i}"), file_bytes[i])
    assert_layer_computes(layer, dense, 2, native=False)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_an_embedding_sharing_the_blocks_follows_them_into_runs_and_back(kind):
    """A tied LM head: the head's method rearranges the table, the embedding's lookups
    (in torch and in the captured step's C) then unpack the runs they read."""
    from kvserve.kernels import load_kernels
    from kvserve.model.execution import ExecutionMode
    from kvserve.model.gguf.linear import FORMAT_CODES, IN_RUNS, BlockEmbedding
    kernels = load_kernels()
    if not kernels.available:
        pytest.fail(f"the native kernels did not build: {kernels.reason}")
    vocab = 16  # two runs of eight rows, four of four
    with torch.device("meta"):
        head = Linear(K, vocab, bias=False)
    method = GGUFLinearMethod.install(head, [vocab])
    method.int8_activations = False  # the float sums: dequantize-then-multiply's
    head.to_empty(device="cpu")
    blocks = torch.from_numpy(random_blocks(kind, vocab * K // BLOCKS[kind][0], seed=1)
                              ).reshape(vocab, -1)
    embedding = BlockEmbedding(vocab, K)
    embedding.load(BlockWeight(kind, blocks, K))
    method.load(head, None, BlockWeight(kind, embedding.gguf_blocks, K, embedding))
    table = BlockWeight(kind, blocks.clone(), K).dequantize()
    tokens = torch.tensor([[0, 5, 11], [7, 3, 3]])
    head.configure(ExecutionMode(kernels=kernels))
    assert method.kinds == [IN_RUNS[kind]] and embedding.kind == IN_RUNS[kind]
    assert embedding.gguf_blocks is head.gguf_part0  # one table, not a copy
    assert torch.equal(embedding(tokens), table[tokens])
    for token in (0, 6, 11, 15):  # the captured step's lookup
        assert torch.equal(kernels.gguf_dequantize_row(
            embedding.gguf_blocks, token, K, FORMAT_CODES[embedding.kind]), table[token])
    assert_layer_computes(head, table, 2, native=True)
    head.configure(ExecutionMode(kernels=None))
    assert embedding.kind == kind and torch.equal(embedding.gguf_blocks, blocks)
    assert embedding.gguf_blocks is head.gguf_part0
    assert torch.equal(embedding(tokens), table[tokens])

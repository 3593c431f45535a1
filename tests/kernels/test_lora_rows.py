"""The LoRA kernel (lora.c) against torch's products on its native, AVX2 and plain-C
builds: rows of several slots and of none, ranks below the slots' maximum (the padding
skipped), output slices of uneven widths, a row count past one thread's share."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels import load_kernels
from kvserve.lora.adapter import AdaptedLayer
from kvserve.lora.layers import LoRALayer, LoRARows

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kernels.available, reason=f"no C compiler: {kernels.reason}")


def layer_with_adapters(kernels, slices: list[int], in_dim: int, ranks: list[int],
                        max_rank: int, g: torch.Generator) -> LoRALayer:
    rows = LoRARows()
    layer = LoRALayer(in_dim, slices, len(ranks), max_rank, torch.float32, rows, kernels)
    for slot, rank in enumerate(ranks):
        layer.load(slot, AdaptedLayer({i: (torch.randn(rank, in_dim, generator=g),
                                           torch.randn(size, rank, generator=g))
                                       for i, size in enumerate(slices)}))
    return layer


@pytest.mark.parametrize("slices, in_dim", [([64], 64), ([48, 24, 24], 100), ([35, 35], 17)])
@pytest.mark.parametrize("rows", [1, 7, 65])
def test_lora_rows_matches_torch(build, slices, in_dim, rows):
    g = torch.Generator().manual_seed(rows * 31 + in_dim)
    native = layer_with_adapters(build, slices, in_dim, [3, 8, 5], 8, g)
    reference = LoRALayer(in_dim, slices, 3, 8, torch.float32, native.rows, None)
    reference.a, reference.b, reference.ranks = native.a, native.b, native.ranks
    x = torch.randn(rows, in_dim, generator=g)
    slots = torch.randint(-1, 3, (rows,), generator=g)
    native.rows.set(slots.numpy())
    base = torch.randn(rows, sum(slices), generator=g)
    want, got = base.clone(), base.clone()
    reference.add_to(x, want)
    native.add_to(x, got)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    untouched = slots < 0
    assert torch.equal(got[untouched], base[untouched])


def test_the_layer_adds_its_adapters_in_chunks_of_rows():
    """A large MLP's rows run in chunks: each chunk reads its own rows' slots."""
    from kvserve.model.layers import in_row_chunks
    g = torch.Generator().manual_seed(0)
    layer = layer_with_adapters(None, [16], 8, [2, 4], 4, g)
    x = torch.randn(10, 8, generator=g)
    slots = torch.tensor([0, 1, -1, 1, 0, 0, 1, -1, 0, 1])
    layer.rows.set(slots.numpy())

    def adapted(chunk):
        out = torch.zeros(chunk.shape[0], 16)
        layer.add_to(chunk, out)
        return out
    whole = adapted(x)
    import kvserve.model.layers as layers
    old = layers.MAX_INTERMEDIATE_BYTES
    layers.MAX_INTERMEDIATE_BYTES = 4 * 16 * 3  # three rows a chunk
    try:
        chunked = in_row_chunks(adapted, x, 16, layer.rows)
    finally:
        layers.MAX_INTERMEDIATE_BYTES = old
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)

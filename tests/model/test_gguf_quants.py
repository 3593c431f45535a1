"""kvserve's dequantization of GGUF's block formats against gguf-py's (the reference
implementation the llama.cpp project ships with its format): blocks of every format,
their scales and codes drawn at random, and values quantized by gguf-py itself."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference, quantize

from kvserve.model.gguf.quants import BLOCKS, dequantize
from kvserve.model.gguf.quants import random_blocks

@pytest.mark.parametrize("kind", list(BLOCKS))
def test_random_blocks_dequantize_as_gguf_py_does(kind):
    values, nbytes = BLOCKS[kind]
    raw = random_blocks(kind, 64, seed=len(kind)).reshape(8, -1)  # 8 rows of 8 blocks
    want = reference(raw, GGMLQuantizationType[kind])
    got = dequantize(torch.from_numpy(raw), kind, (8, 8 * values))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_values_quantized_by_gguf_py_come_back_alike(kind):
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    raw = quantize(x, GGMLQuantizationType[kind])
    got = dequantize(torch.from_numpy(raw), kind, (4, 256))
    np.testing.assert_allclose(got.numpy(), reference(raw, GGMLQuantizationType[kind]),
                               rtol=1e-6, atol=1e-6)
    assert np.abs(got.numpy() - x).max() < (0.02 if kind == "Q8_0" else 0.3)


def test_unsupported_formats_and_ragged_rows_are_named():
    with pytest.raises(ValueError, match="GGUF tensor type IQ2_XS is not supported; "
                                         "supported: F32, F16, BF16, Q8_0"):
        dequantize(torch.zeros(10, dtype=torch.uint8), "IQ2_XS", (1, 10))
    with pytest.raises(ValueError, match="a Q4_K row of 100 values is not whole blocks"):
        dequantize(torch.zeros(144, dtype=torch.uint8), "Q4_K", (1, 100))

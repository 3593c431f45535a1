"""Shared layer helpers."""
from __future__ import annotations

import torch

from kvserve.model.layers import MAX_INTERMEDIATE_BYTES, in_row_chunks


def test_in_row_chunks_bounds_each_call_and_keeps_rows_in_order():
    x = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    seen = []

    def fn(chunk):
        seen.append(chunk.shape[0])
        return chunk * 2

    per_row = MAX_INTERMEDIATE_BYTES // 16  # elements of 4 bytes: four rows fit
    assert torch.equal(in_row_chunks(fn, x, per_row), x * 2)
    assert seen == [4, 4, 2]
    seen.clear()
    assert torch.equal(in_row_chunks(fn, x, 1), x * 2) and seen == [10]
    seen.clear()  # a row larger than the limit still runs, one row at a time
    assert torch.equal(in_row_chunks(fn, x[:2], MAX_INTERMEDIATE_BYTES), x[:2] * 2)
    assert seen == [1, 1]

"""The step's input tensors: the decode-only shortcut builds exactly what the general
path builds for the same step."""
from __future__ import annotations

import pytest
import torch

from kvserve.core.scheduler_output import SamplingInfo, ScheduledRequest
from kvserve.kernels import Kernels
from kvserve.sampling_params import SamplingParams
from kvserve.worker import input_batch

INFO = SamplingInfo(SamplingParams(), (), (), None)


@pytest.fixture(scope="module")
def native():
    kernels = Kernels()
    if not kernels.available:
        pytest.fail(f"native kernels did not build: {kernels.reason}")
    return kernels


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("positions", [[0], [7], [3, 40, 16, 15], [31, 0, 64]])
def test_decode_shortcut_equals_the_general_path(native, positions, window):
    bs = 16
    # tables of their own length, one longer than needed: padding and slicing both show
    scheduled = [ScheduledRequest(f"r{i}", [100 + i], p,
                                  list(range(10 * i, 10 * i + p // bs + 1 + i % 2)), INFO)
                 for i, p in enumerate(positions)]
    fast = input_batch.build_inputs(scheduled, bs, window, native)
    general = input_batch._flat_inputs(scheduled, bs, window, native)
    for name in ("tokens", "positions", "sample_rows"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    for name in ("slot_mapping", "row_block_tables", "row_seq_lens"):
        a, b = getattr(fast.meta, name), getattr(general.meta, name)
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b), name
    assert fast.meta.num_decodes == general.meta.num_decodes == len(positions)
    assert fast.meta.sliding_window == general.meta.sliding_window
    assert [s.request_id for s in fast.sample_order] == [s.request_id for s in general.sample_order]
    assert fast.num_draft_rows == 0 and fast.prompt_rows is None


def test_prefills_drafts_and_unsampled_rows_build_as_before(native):
    info = INFO
    prefill = ScheduledRequest("p", [5, 6, 7], 0, [0], info)
    draft = ScheduledRequest("d", [5, 6], 3, [1], info, num_draft_tokens=1)
    chunk = ScheduledRequest("c", [5], 3, [2], None)  # a prompt chunk that samples nothing
    for scheduled in ([prefill], [draft], [chunk]):
        got = input_batch.build_inputs(scheduled, 16, None, native)
        want = input_batch._flat_inputs(scheduled, 16, None, native)
        assert torch.equal(got.sample_rows, want.sample_rows)
        assert torch.equal(got.meta.slot_mapping, want.meta.slot_mapping)

"""The runner sends only the sampling rows through the model's last layer."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM
from kvserve.core.scheduler_output import SamplingInfo, ScheduledRequest
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import build_inputs

SAMPLING = SamplingInfo(SamplingParams(), [], [], None)


def _step(runner, first_block: int):
    """A decode, a whole prompt and a first chunk (no sample) in one flat batch."""
    gen = torch.Generator().manual_seed(0)  # the same tokens in any blocks
    tokens = lambda n: torch.randint(3, 200, (n,), generator=gen).tolist()
    blocks = lambda i: list(range(first_block + 8 * i, first_block + 8 * (i + 1)))
    scheduled = [ScheduledRequest("decode", tokens(1), 0, blocks(0), SAMPLING),
                 ScheduledRequest("prompt", tokens(13), 0, blocks(1), SAMPLING),
                 ScheduledRequest("chunk", tokens(9), 0, blocks(2), None)]
    return build_inputs(scheduled, runner.block_size, runner.config.sliding_window,
                        runner.native_attention)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_last_layer_on_sampling_rows_only(model_dirs, arch, backend):
    runner = LLM(model_dirs(arch), num_kv_blocks=64, block_size=4,
                 attention_backend=backend).engine.worker.runner
    model, caches = runner.model, runner.caches
    with torch.inference_mode():
        full_inputs, part_inputs = _step(runner, 0), _step(runner, 24)
        full = model(full_inputs.tokens, full_inputs.positions, caches, full_inputs.meta)
        rows = part_inputs.sample_rows
        assert rows.tolist() == [0, 13]  # the decode and the prompt's last token
        part = model(part_inputs.tokens, part_inputs.positions, caches, part_inputs.meta, rows)
    assert part.shape == (2, full.shape[1])
    torch.testing.assert_close(part, full[rows], rtol=1e-5, atol=1e-5)
    full_slots, part_slots = full_inputs.meta.slot_mapping, part_inputs.meta.slot_mapping
    for cache in caches:  # every row's K/V written, the chunk's included
        for part_kv, full_kv in zip(cache.read(part_slots), cache.read(full_slots)):
            assert torch.equal(part_kv, full_kv)
            assert part_kv.abs().amin(dim=(1, 2)).gt(0).all()

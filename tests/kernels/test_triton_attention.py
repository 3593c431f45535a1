"""The Triton paged attention and KV writer, run by Triton's interpreter on the CPU (or
compiled, on a GPU where torch sees one: tools/gpu_check.sh), against the torch path the
engine runs: ragged rows (decode rows, prompt chunks), block tables with holes, grouped
heads, sliding windows, split contexts, every KV dtype."""
from __future__ import annotations

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton compiles anything: the CPU runs it

import pytest  # noqa: E402

from kvserve.core.scheduler_output import ScheduledRequest  # noqa: E402
from kvserve.kernels import triton_attention as ta  # noqa: E402
from kvserve.model.attention import KVCache, paged_attention  # noqa: E402
from kvserve.worker.input_batch import build_inputs  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 2, 16


def _step(seed: int, block_size: int, lengths: list[tuple[int, int]]):
    """Requests (tokens already cached, new tokens) over a pool whose blocks are handed
    out in a shuffled order (tables with holes), as ScheduledRequests."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + n) // block_size) for c, n in lengths)
    order = torch.randperm(need + 7, generator=gen).tolist()
    scheduled, at = [], 0
    for i, (cached, new) in enumerate(lengths):
        blocks = -(-(cached + new) // block_size)
        scheduled.append(ScheduledRequest(f"r{i}", [0] * new, cached, order[at:at + blocks],
                                          None))
        at += blocks
    return scheduled, need + 7


def _rows(scheduled, block_size: int):
    """Each query row's table and length, as the native metadata gives them."""
    width = max(len(s.block_table) for s in scheduled)
    tables, lens = [], []
    decodes = [s for s in scheduled if len(s.token_ids) == 1]
    for s in decodes + [s for s in scheduled if len(s.token_ids) > 1]:
        for p in range(s.start_pos, s.start_pos + len(s.token_ids)):
            tables.append(s.block_table + [0] * (width - len(s.block_table)))
            lens.append(p + 1)
    return torch.tensor(tables), torch.tensor(lens)


CASES = [(dtype, *shape) for dtype in (torch.float32, torch.float16, torch.bfloat16)
         for shape in ((4, 0, 1), (8, 0, 4), (16, 11, 2), (4, 6, None))]
FAST = {(torch.float32, 8, 0, 4), (torch.float16, 16, 11, 2), (torch.bfloat16, 4, 6, None)}


# the interpreter is slow: three cases in `make test`, the rest in `make test-slow`
@pytest.mark.parametrize("dtype, block_size, window, splits", [
    case if case in FAST else pytest.param(*case, marks=pytest.mark.slow) for case in CASES])
def test_rows_attend_as_the_torch_path(dtype, block_size, window, splits):
    lengths = [(37, 1), (0, 9), (5, 1), (20, 13), (64, 1)]
    scheduled, num_blocks = _step(block_size * 7 + window, block_size, lengths)
    inputs = build_inputs(scheduled, block_size, window or None)
    t = len(inputs.tokens)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(t, HEADS, DIM, generator=gen)
    k, v = (torch.randn(t, KV_HEADS, DIM, generator=gen) for _ in range(2))
    # the context before each chunk, written by the torch path and by the Triton writer
    cache = KVCache(num_blocks, block_size, KV_HEADS, DIM, dtype,
                    lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=DEVICE))
    past = [ScheduledRequest(s.request_id, [0] * s.start_pos, 0, s.block_table, None)
            for s in scheduled if s.start_pos]
    before = build_inputs(past, block_size, None)
    pk, pv = (torch.randn(len(before.tokens), KV_HEADS, DIM, generator=gen) for _ in range(2))
    on = lambda t: t.to(DEVICE)  # noqa: E731
    ta.write_kv(on(pk), on(pv), on(before.meta.slot_mapping), cache.k, cache.v)
    ta.write_kv(on(k), on(v), on(inputs.meta.slot_mapping), cache.k, cache.v)
    reference = KVCache(num_blocks, block_size, KV_HEADS, DIM, dtype)
    reference.write(before.meta.slot_mapping, pk, pv)
    want = paged_attention(q, k, v, reference, inputs.meta, DIM ** -0.5)  # writes k, v too
    # bfloat16: the interpreter narrows by truncation, a GPU to nearest; one unit apart
    exact = dtype != torch.bfloat16
    for ours, theirs in ((cache.k.cpu(), reference.k), (cache.v.cpu(), reference.v)):
        assert torch.equal(ours, theirs) if exact else \
            torch.allclose(ours.float(), theirs.float(), rtol=2 ** -7, atol=0)
    tables, lens = _rows(scheduled, block_size)
    got = ta.paged_attention_rows(on(q), on(reference.k), on(reference.v), on(tables),
                                  on(lens), DIM ** -0.5, window, splits).cpu()
    assert torch.allclose(got, want.float(), atol=2e-5), (got - want).abs().max()


def test_a_padding_slot_is_not_written():
    cache = KVCache(2, 4, KV_HEADS, DIM, torch.float32,
                    lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=DEVICE))
    k = torch.ones(2, KV_HEADS, DIM, device=DEVICE)
    ta.write_kv(k, k, torch.tensor([5, -1], device=DEVICE), cache.k, cache.v)
    assert int((cache.k != 0).sum()) == KV_HEADS * DIM  # slot 5 only


def test_splits_grow_with_the_context_and_shrink_with_the_rows():
    assert ta.splits_for(4, 1, 8) == 1
    assert ta.splits_for(256, 1, 8) == 16
    assert ta.splits_for(256, 64, 8) == 1

"""Turn a SchedulerOutput into the step's flat input tensors and attention metadata."""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.core.kv.groups import KVGroups
from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.kernels import Kernels
from kvserve.model.attention import AttentionMetadata, PrefillSpan


@dataclass
class StepInputs:
    tokens: torch.Tensor           # [T]
    positions: torch.Tensor        # [T]
    meta: AttentionMetadata
    order: list[ScheduledRequest]  # decodes first, then prefill chunks
    sample_rows: torch.Tensor      # flat rows that give logits: each sampling request's
    sample_order: list[ScheduledRequest]  # last token, and its draft tokens' rows before it
    num_draft_rows: int = 0
    # prompt logprobs: rows whose logits score the next prompt token, and per request
    # (request, position of the first token scored, the tokens scored)
    prompt_rows: torch.Tensor | None = None
    prompt_spans: list[tuple[ScheduledRequest, int, list[int]]] | None = None
    # embedding requests: rows whose hidden states are pooled, and per chunk (request,
    # how many of those rows are its)
    pool_rows: torch.Tensor | None = None
    pool_spans: list[tuple[ScheduledRequest, int]] | None = None

    def to(self, device: torch.device) -> StepInputs:
        """The same step with its tensors on ``device`` (built on the CPU: a GPU worker's
        step copies them over once, without waiting)."""
        if device.type == "cpu":
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return dataclasses.replace(
            self, tokens=move(self.tokens), positions=move(self.positions),
            meta=_meta_to(self.meta, move), sample_rows=move(self.sample_rows),
            prompt_rows=move(self.prompt_rows), pool_rows=move(self.pool_rows))


def _meta_to(meta: AttentionMetadata, move) -> AttentionMetadata:
    return dataclasses.replace(
        meta, slot_mapping=move(meta.slot_mapping),
        decode_block_tables=move(meta.decode_block_tables), decode_mask=move(meta.decode_mask),
        row_block_tables=move(meta.row_block_tables), row_seq_lens=move(meta.row_seq_lens),
        prefills=[dataclasses.replace(p, block_table=move(p.block_table), mask=move(p.mask))
                  for p in meta.prefills],
        windowed={key: _meta_to(m, move) for key, m in meta.windowed.items()})


def _pad_tables(tables: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(tables), max(width, 1)), dtype=np.int64)
    for row, table in enumerate(tables):
        out[row, :len(table)] = table
    return out


def _window_ok(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None,
               sinks: int = 0) -> torch.Tensor:
    if window is None:
        return torch.ones((), dtype=torch.bool)
    inside = key_pos > query_pos - window
    return inside | (key_pos < sinks) if sinks else inside


def build_inputs(scheduled: list[ScheduledRequest], block_size: int,
                 sliding_window: int | None, native: Kernels | None = None,
                 layer_windows: tuple[int, ...] = (), groups: KVGroups | None = None,
                 sinks: int = 0) -> StepInputs:
    """``native``: attention by the native kernel, every row in one call (no gathered
    copy, no mask). ``layer_windows``: windows some layers have of their own; their
    metadata goes in ``meta.windowed``, by window, or with ``groups`` by (window, group),
    read through each group's own block tables. ``sinks``: the first tokens every token
    sees beside its window (torch attention path)."""
    decodes = native is not None and decodes_only(scheduled)
    if sinks:
        if native is not None:
            raise ValueError("attention sinks run on the torch attention path")
        inputs = _flat_inputs(scheduled, block_size, sliding_window, None, sinks)
        inputs.meta.sinks, inputs.meta.sliding_window = sinks, sliding_window or 0
        return inputs
    build = _decode_inputs if decodes else _flat_inputs
    inputs = build(scheduled, block_size, sliding_window, native)
    if groups is not None:
        for g, window in enumerate(groups.windows):
            if window:
                own = [dataclasses.replace(s, block_table=s.group_tables[g - 1])
                       if s.group_tables else s for s in scheduled]
                inputs.meta.windowed[(window, g)] = build(
                    own, block_size, window,
                    native if inputs.meta.native is not None else None).meta
        return inputs
    for window in sorted(set(layer_windows) - {0, sliding_window or 0}):
        inputs.meta.windowed[window] = (
            dataclasses.replace(inputs.meta, sliding_window=window, windowed={})
            if inputs.meta.native is not None
            else _flat_inputs(scheduled, block_size, window, None).meta)
    return inputs


def decodes_only(scheduled: list[ScheduledRequest]) -> bool:
    """Whether every request decodes one token, sampled, with no prompt logprobs."""
    return all(len(s.token_ids) == 1 and s.sampling is not None
               and s.prompt_logprobs is None for s in scheduled)


def _flat_inputs(scheduled: list[ScheduledRequest], block_size: int,
                 sliding_window: int | None, native: Kernels | None,
                 sinks: int = 0) -> StepInputs:
    """Any step: decodes, prefill chunks, drafts, prompt logprobs, either attention."""
    decodes = [s for s in scheduled if len(s.token_ids) == 1]
    prefills = [s for s in scheduled if len(s.token_ids) > 1]
    order = decodes + prefills
    q_lens = np.array([len(s.token_ids) for s in order], dtype=np.int64)
    starts = np.array([s.start_pos for s in order], dtype=np.int64)
    tokens = np.fromiter((t for s in order for t in s.token_ids), dtype=np.int64,
                         count=int(q_lens.sum()))
    seq_ids = np.repeat(np.arange(len(order)), q_lens)
    offsets = np.arange(len(tokens)) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
    positions = starts[seq_ids] + offsets
    tables = _pad_tables([s.block_table for s in order],
                         max(len(s.block_table) for s in order))
    slots = tables[seq_ids, positions // block_size] * block_size + positions % block_size

    nd = len(decodes)
    slot_mapping = torch.from_numpy(slots)
    if native is not None:  # one kernel call: each row sees keys up to its own position
        width = int(positions.max()) // block_size + 1
        meta = AttentionMetadata(
            slot_mapping, nd, native=native, sliding_window=sliding_window or 0,
            row_block_tables=torch.from_numpy(np.ascontiguousarray(tables[seq_ids, :width])),
            row_seq_lens=torch.from_numpy(positions + 1))
    else:
        meta = AttentionMetadata(slot_mapping, nd, prefills=_prefill_spans(
            prefills, tables[nd:], nd, block_size, sliding_window, sinks))
        if nd:
            _decode_meta(meta, tables[:nd], starts[:nd], block_size, sliding_window, sinks)

    ends = np.cumsum(q_lens) - 1
    sample_idx = [i for i, s in enumerate(order) if s.sample]
    rows = ends[sample_idx]
    num_drafts = sum(order[i].num_draft_tokens for i in sample_idx)
    if num_drafts:  # a drafted request's rows: its last token's and each draft's, in order
        rows = np.concatenate([np.arange(ends[i] - order[i].num_draft_tokens, ends[i] + 1)
                               for i in sample_idx])
    inputs = StepInputs(
        tokens=torch.from_numpy(tokens), positions=torch.from_numpy(positions), meta=meta,
        order=order, sample_rows=torch.from_numpy(rows),
        sample_order=[order[i] for i in sample_idx], num_draft_rows=num_drafts)
    if any(s.prompt_logprobs is not None for s in order):
        _add_prompt_rows(inputs, order, ends)
    if any(s.pooling is not None for s in order):
        _add_pool_rows(inputs, order, ends)
    return inputs


def _add_pool_rows(inputs: StepInputs, order: list[ScheduledRequest], ends: np.ndarray
                   ) -> None:
    """The rows an embedding chunk pools: all of them for a mean, the prompt's first
    for ``cls``, its last (once the chunk ends the prompt) for ``last``."""
    rows, spans = [], []
    for i, s in enumerate(order):
        if s.pooling is None:
            continue
        first = int(ends[i]) - len(s.token_ids) + 1
        kind = s.pooling.pooling
        if kind == "mean":
            span = np.arange(first, int(ends[i]) + 1)
        elif kind == "cls":
            span = np.arange(first, first + 1) if s.start_pos == 0 else np.arange(0)
        else:
            span = np.arange(int(ends[i]), int(ends[i]) + 1) if s.pool_done else np.arange(0)
        rows.append(span)
        spans.append((s, len(span)))
    inputs.pool_rows = torch.from_numpy(np.concatenate(rows))
    inputs.pool_spans = spans


@dataclass
class DecodeFields:
    """A step of decodes only as plain lists, one entry per request: what the native
    kernels read of it (the tables padded with block 0 to a common width)."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    width: int


def decode_fields(scheduled: list[ScheduledRequest], block_size: int) -> DecodeFields:
    positions = [s.start_pos for s in scheduled]
    width = max(positions) // block_size + 1
    tables = [(s.block_table + [0] * width)[:width] for s in scheduled]
    return DecodeFields(
        tokens=[s.token_ids[0] for s in scheduled], positions=positions,
        slots=[t[p // block_size] * block_size + p % block_size
               for t, p in zip(tables, positions)],
        seq_lens=[p + 1 for p in positions], tables=tables, width=width)


def _decode_inputs(scheduled: list[ScheduledRequest], block_size: int,
                   sliding_window: int | None, native: Kernels) -> StepInputs:
    """A step of decodes only, for the native kernel: the same tensors as the general
    path, from a few small lists. Decode steps are the ones whose host work is most of
    what is not streaming weights, and this runs right after a step evicted the caches,
    where each torch call costs many times its warm price: the fewer, the better."""
    f = decode_fields(scheduled, block_size)
    meta = AttentionMetadata(
        torch.tensor(f.slots), len(scheduled), native=native,
        sliding_window=sliding_window or 0, row_block_tables=torch.tensor(f.tables),
        row_seq_lens=torch.tensor(f.seq_lens))
    return StepInputs(tokens=torch.tensor(f.tokens), positions=torch.tensor(f.positions),
                      meta=meta, order=list(scheduled), sample_rows=torch.arange(len(scheduled)),
                      sample_order=list(scheduled))


def _add_prompt_rows(inputs: StepInputs, order: list[ScheduledRequest], ends: np.ndarray
                     ) -> None:
    """Row p of a chunk scores prompt token p + 1, up to the prompt's last token (whose
    row samples the first output token)."""
    rows, spans = [], []
    for i, s in enumerate(order):
        info = s.prompt_logprobs
        if info is None:
            continue
        first_row = int(ends[i]) - len(s.token_ids) + 1
        stop = min(s.start_pos + len(s.token_ids), len(info.prompt_token_ids) - 1)
        count = stop - s.start_pos
        if count > 0:
            rows.append(np.arange(first_row, first_row + count))
            spans.append((s, s.start_pos + 1,
                          list(info.prompt_token_ids[s.start_pos + 1:stop + 1])))
    if rows:
        inputs.prompt_rows = torch.from_numpy(np.concatenate(rows))
        inputs.prompt_spans = spans


def _decode_meta(meta: AttentionMetadata, tables: np.ndarray, starts: np.ndarray,
                 block_size: int, window: int | None, sinks: int = 0) -> None:
    width = int(starts.max()) // block_size + 1
    meta.decode_block_tables = torch.from_numpy(np.ascontiguousarray(tables[:, :width]))
    key_pos = torch.arange(width * block_size)[None, :]
    query_pos = torch.from_numpy(starts)[:, None]
    mask = (key_pos <= query_pos) & _window_ok(key_pos, query_pos, window, sinks)
    meta.decode_mask = mask[:, None, None, :]


def _prefill_spans(prefills: list[ScheduledRequest], tables: np.ndarray, first_row: int,
                   block_size: int, window: int | None, sinks: int = 0) -> list[PrefillSpan]:
    spans, row = [], first_row
    for s, table in zip(prefills, tables):
        q_len, start = len(s.token_ids), s.start_pos
        block_table, mask = None, None
        if start:  # keys before the chunk are in the pool: read the context back
            width = (start + q_len - 1) // block_size + 1
            block_table = torch.from_numpy(np.ascontiguousarray(table[:width]))
            key_pos = torch.arange(width * block_size)[None, :]
        else:
            key_pos = torch.arange(q_len)[None, :]
        if start or (window is not None and window < q_len):
            query_pos = torch.arange(start, start + q_len)[:, None]
            mask = (key_pos <= query_pos) & _window_ok(key_pos, query_pos, window, sinks)
        spans.append(PrefillSpan(row, q_len, block_table, mask))
        row += q_len
    return spans

"""Paged attention and the KV writer in Triton, over kvserve's pool layout, for a GPU
worker; tested on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set before
this module is imported).

The pool is the native kernel's: per block and kv head, keys transposed ``[D][bs]`` and
values ``[bs][D]`` (see ``kvserve.model.attention.KVCache``). Every query row attends the
keys of its own block table up to its own length (decode rows and prompt-chunk rows
alike, as ``AttentionMetadata``'s row tables give them), within a sliding window when
there is one, with one online softmax per (row, head). Long contexts are split over
programs (split-K) whose partial sums a second kernel merges.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG = -1.0e30  # the running maximum before any key: finite, so exp(m - m_new) is 0


@triton.jit
def _attend_rows(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, stat_ptr,
                 scale, window, blocks_per_split,
                 stride_qt, stride_qh, stride_tt, stride_ot, stride_oh,
                 stride_kb, stride_kh, stride_vb, stride_vh,
                 GROUP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                 SPLITS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    length = tl.load(lens_ptr + row)
    start = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    first = start // BS + split * blocks_per_split
    stop = tl.minimum((length - 1) // BS + 1, first + blocks_per_split)
    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + d).to(tl.float32)
    m = tl.full((), _NEG, tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for b in range(first, stop):
        block = tl.load(tables_ptr + row * stride_tt + b)
        keys = tl.load(k_ptr + block * stride_kb + kv_head * stride_kh
                       + d[:, None] * BS + j[None, :]).to(tl.float32)
        scores = tl.sum(q[:, None] * keys, axis=0) * scale
        pos = b * BS + j
        scores = tl.where((pos < length) & (pos >= start), scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        values = tl.load(v_ptr + block * stride_vb + kv_head * stride_vh
                         + j[:, None] * D + d[None, :]).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * values, axis=0)
        total = total * alpha + tl.sum(p, axis=0)
        m = m_new
    if SPLITS == 1:
        tl.store(out_ptr + row * stride_ot + head * stride_oh + d, acc / total)
    else:
        at = (row * tl.num_programs(1) + head) * SPLITS + split
        tl.store(part_ptr + at * D + d, acc)
        tl.store(stat_ptr + at * 2, m)
        tl.store(stat_ptr + at * 2 + 1, total)


@triton.jit
def _merge_splits(out_ptr, part_ptr, stat_ptr, stride_ot, stride_oh,
                  D: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    base = (row * tl.num_programs(1) + head) * SPLITS
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    m = tl.load(stat_ptr + (base + s) * 2)
    total = tl.load(stat_ptr + (base + s) * 2 + 1)
    weight = tl.exp(m - tl.max(m, axis=0))
    parts = tl.load(part_ptr + (base + s)[:, None] * D + d[None, :])
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.sum(weight * total, axis=0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out)


@triton.jit
def _write_kv(k_ptr, v_ptr, slots_ptr, k_pool, v_pool, stride_kt, stride_kh,
              stride_vt, stride_vh, stride_pb, stride_ph, stride_qb, stride_qh,
              D: tl.constexpr, BS: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        block, offset = slot // BS, slot % BS
        d = tl.arange(0, D)
        key = tl.load(k_ptr + token * stride_kt + head * stride_kh + d)
        value = tl.load(v_ptr + token * stride_vt + head * stride_vh + d)
        tl.store(k_pool + block * stride_pb + head * stride_ph + d * BS + offset,
                 key.to(k_pool.dtype.element_ty))
        tl.store(v_pool + block * stride_qb + head * stride_qh + offset * D + d,
                 value.to(v_pool.dtype.element_ty))


def write_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    """Store k/v [T, kv_heads, D] at flat slots [T] (negative: skipped) of the pools."""
    t, heads, dim = k.shape
    _write_kv[(t, heads)](k, v, slot_mapping, k_pool, v_pool, k.stride(0), k.stride(1),
                          v.stride(0), v.stride(1), k_pool.stride(0), k_pool.stride(1),
                          v_pool.stride(0), v_pool.stride(1), D=dim, BS=k_pool.shape[3])


def splits_for(max_blocks: int, rows: int, heads: int, target_programs: int = 256) -> int:
    """How many programs split each row's context: enough to give a few-row step of
    long contexts ``target_programs`` programs, a power of two, at most 16."""
    want = max(1, min(16, target_programs // max(1, rows * heads), max_blocks // 8))
    return 1 << (want.bit_length() - 1)


def paged_attention_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         window: int = 0, splits: int | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, D] (float32, contiguous; made here unless given): row t
    attends the keys of ``tables[t]`` before ``seq_lens[t]`` (the last ``window`` of them
    when ``window`` > 0)."""
    rows, heads, dim = q.shape
    kv_heads, bs = k_pool.shape[1], k_pool.shape[3]
    if out is None:
        out = torch.empty((rows, heads, dim), dtype=torch.float32, device=q.device)
    max_blocks = tables.shape[1]
    splits = splits or splits_for(max_blocks, rows, heads)
    per_split = -(-max_blocks // splits)
    part = stat = out  # unused placeholders when not split
    if splits > 1:
        part = torch.empty((rows, heads, splits, dim), dtype=torch.float32, device=q.device)
        stat = torch.empty((rows, heads, splits, 2), dtype=torch.float32, device=q.device)
    _attend_rows[(rows, heads, splits)](
        q, k_pool, v_pool, tables, seq_lens, out, part, stat, scale, window, per_split,
        q.stride(0), q.stride(1), tables.stride(0), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        GROUP=heads // kv_heads, D=dim, BS=bs, SPLITS=splits)
    if splits > 1:
        _merge_splits[(rows, heads)](out, part, stat, out.stride(0), out.stride(1), D=dim,
                                     SPLITS=splits)
    return out


def supports(head_dim: int, block_size: int) -> str:
    """Why these kernels cannot serve a model's heads and pool ("" when they can): their
    tiles span a whole head and a whole block, so both are powers of two."""
    for name, value in (("head_dim", head_dim), ("block_size", block_size)):
        if value & (value - 1):
            return f"{name} {value} is not a power of two"
    return ""


class TritonAttention:
    """The attention backend of the GPU worker, with the native kernels' interface (what
    ``kvserve.model.attention.paged_attention`` calls): every row over its own block
    table, and the KV writer."""

    def paged_attention_rows(self, q, k_pool, v_pool, tables, seq_lens, out, scale: float,
                             window: int) -> None:
        if q.stride(2) != 1:
            q = q.contiguous()
        paged_attention_rows(q, k_pool, v_pool, tables, seq_lens, scale, window, out=out)

    def write_kv(self, k, v, slots, k_pool, v_pool) -> None:
        write_kv(k, v, slots, k_pool, v_pool)

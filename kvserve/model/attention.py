"""Attention over a paged KV pool, for a flat batch of decodes and prefill chunks.

The flat batch holds decode tokens first (one per request), then the prefill chunks,
each request's tokens contiguous. With the native kernel every row — decode or prefill
token — is one call: each row attends to its own number of keys through its block
table, which is causal attention for a chunk whose K/V were just written to the pool,
and it beats SDPA on prompts as well as decodes (no gathered copy, no mask). The
torch path runs the decodes as one batched SDPA over gathered blocks, and each prefill
chunk as one SDPA at its own shape (one padded batch wasted more on padding and lost the
causal fast path than the loop costs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.kernels import Kernels


@dataclass
class PrefillSpan:
    """One request's prefill chunk: rows [row, row + length) of the flat batch.

    block_table [n]: the blocks of its whole context, set when keys before the chunk
    are cached (they are read back from the pool); None: the chunk is the whole
    context so far, and its fresh K/V are used directly.
    mask [length, keys]: which keys each query may see; None means plain causal.
    """

    row: int
    length: int
    block_table: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Tensors describing one step's flat batch (built once per step, shared by layers).

    slot_mapping[t]: flat KV slot where token t's K/V are written.
    Native kernel (``native`` set): row_block_tables [T, B] / row_seq_lens [T], each
    row's blocks and how many keys it sees; the other fields are unused.
    Torch path: decode_block_tables [D, Bd] / decode_mask [D, 1, 1, Ld], the decodes'
    blocks and valid keys; prefills, the prefill chunks after the decodes.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    row_block_tables: torch.Tensor | None = None
    row_seq_lens: torch.Tensor | None = None
    native: Kernels | None = None  # native kernel, when built and the dtype fits
    sliding_window: int = 0
    sinks: int = 0  # StreamingLLM: keys before this position are seen beside the window
    # the same step for layers of another window (models mixing local and global layers)
    windowed: dict[int, "AttentionMetadata"] = field(default_factory=dict)


class KVCache:
    """The K and V pools of one layer, laid out for the attention kernel to stream:

    k [num_blocks, kv_heads, head_dim, block_size] (keys transposed within a block)
    v [num_blocks, kv_heads, block_size, head_dim]

    Each kv head's keys or values of a block are one contiguous run, read in address
    order (see kvserve/kernels/paged_attention.c). Slot ``s`` is token ``s % block_size``
    of block ``s // block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, zeros=torch.zeros) -> None:
        """``zeros(shape, dtype)``: allocates a zeroed pool (worker/huge_pages.py's, or
        torch's)."""
        # Zeros, not empty: masked-out keys are multiplied by 0, which must not meet NaN.
        self.k = zeros((num_blocks, num_kv_heads, head_dim, block_size), dtype=dtype)
        self.v = zeros((num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype)

    @property
    def block_size(self) -> int:
        return self.v.shape[2]

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              native: Kernels | None = None) -> None:
        """Store k/v [T, kv_heads, head_dim] at slots [T], through ``native`` when set."""
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if native is not None:
            native.write_kv(_rows_contiguous(k), _rows_contiguous(v), slot_mapping, self.k,
                            self.v)
            return
        blocks, offsets = self._locate(slot_mapping)
        self.k[blocks, :, :, offsets] = k
        self.v[blocks, :, offsets, :] = v

    def read(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V stored at slots [T], each [T, kv_heads, head_dim]."""
        blocks, offsets = self._locate(slot_mapping)
        return self.k[blocks, :, :, offsets], self.v[blocks, :, offsets, :]

    def _locate(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return slot_mapping // self.block_size, slot_mapping % self.block_size

    def gather(self, block_tables: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of each row's blocks as [B, kv_heads, blocks*block_size, head_dim]."""
        b, n = block_tables.shape
        _, h, d, bs = self.k.shape
        k = self.k[block_tables].permute(0, 2, 1, 4, 3).reshape(b, h, n * bs, d)
        v = self.v[block_tables].transpose(1, 2).reshape(b, h, n * bs, d)
        return k.to(dtype), v.to(dtype)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] whose rows are each H x D contiguous (a slice of fused qkv rows is)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float,
                    out_rows: torch.Tensor | None = None,
                    softcap: float | None = None,
                    q_sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, d], k/v [T, Hkv, d] for the step's tokens -> output [T, H, d].

    ``out_rows``: only these rows' outputs are wanted (-> [len(out_rows), H, d]); the K/V
    of every row are still written to the pool. ``softcap``: scores capped as
    ``cap * tanh(score / cap)`` before the softmax (torch path only: a model that caps is
    given no native metadata). ``q_sinks``: with ``meta.sinks``, the queries that score
    the sink keys (StreamingLLM's positions within the cache; torch path only)."""
    cache.write(meta.slot_mapping, k, v, meta.native)
    if meta.native is not None:  # float32 math; a bf16/fp16 model's queries are widened
        if softcap is not None:
            raise ValueError("soft-capped attention runs on the torch path only")
        tables, seq_lens = meta.row_block_tables, meta.row_seq_lens
        if out_rows is not None:
            q, tables, seq_lens = q[out_rows], tables[out_rows], seq_lens[out_rows]
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        meta.native.paged_attention_rows(q.float(), cache.k, cache.v, tables, seq_lens, out,
                                         scale, meta.sliding_window)
        return out.to(q.dtype)
    out = _torch_attention(q, k, v, cache, meta, scale, softcap, q_sinks)
    return out if out_rows is None else out[out_rows]


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor | None, causal: bool, scale: float,
                          softcap: float) -> torch.Tensor:
    """SDPA's result for q [B, H, Q, d], k/v [B, Hkv, K, d], with each score capped as
    ``softcap * tanh(score / softcap)`` before masking (Gemma 2), computed as transformers'
    eager attention does: scores, cap, mask, a float32 softmax, values."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        qn, kn = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(qn, kn, dtype=torch.bool, device=q.device).tril(kn - qn)
    if mask is not None:
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _sink_attention(q: torch.Tensor, q_sinks: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float,
                    sinks: int) -> torch.Tensor:
    """Attention for q [B, H, Q, d] over k/v [B, Hkv, K, d] whose first ``sinks`` keys
    are scored by ``q_sinks`` instead (the same queries rotated to where the window
    starts), one softmax over all of them."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = min(sinks, k.shape[-2])
    scores[..., :s] = torch.matmul(q_sinks, k[..., :s, :].transpose(-1, -2)) * scale
    if causal:
        qn, kn = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(qn, kn, dtype=torch.bool, device=q.device).tril(kn - qn)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                     meta: AttentionMetadata, scale: float,
                     softcap: float | None = None,
                     q_sinks: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(q)
    if cache.k.dtype != k.dtype:  # attend to this step's keys as the pool holds them
        k, v = k.to(cache.k.dtype).to(k.dtype), v.to(cache.v.dtype).to(v.dtype)
    gqa = q.shape[1] != k.shape[1]
    nd = meta.num_decodes
    if nd:
        kd, vd = cache.gather(meta.decode_block_tables, q.dtype)
        qd = q[:nd].unsqueeze(2)  # [D, H, 1, d]
        if q_sinks is not None:
            od = _sink_attention(qd, q_sinks[:nd].unsqueeze(2), kd, vd, meta.decode_mask,
                                 False, scale, meta.sinks)
        elif softcap is None:
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask,
                                                scale=scale, enable_gqa=gqa)
        else:
            od = _softcapped_attention(qd, kd, vd, meta.decode_mask, False, scale, softcap)
        out[:nd] = od.squeeze(2)
    for span in meta.prefills:
        rows = slice(span.row, span.row + span.length)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Q, d]
        if span.block_table is None:
            kp, vp = (x[rows].transpose(0, 1).unsqueeze(0) for x in (k, v))
        else:
            kp, vp = cache.gather(span.block_table.unsqueeze(0), q.dtype)
        if q_sinks is not None:
            op = _sink_attention(qp, q_sinks[rows].transpose(0, 1).unsqueeze(0), kp, vp,
                                 span.mask, span.mask is None, scale, meta.sinks)
        elif softcap is None:
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=span.mask,
                                                is_causal=span.mask is None, scale=scale,
                                                enable_gqa=gqa)
        else:
            op = _softcapped_attention(qp, kp, vp, span.mask, span.mask is None, scale,
                                       softcap)
        out[rows] = op[0].transpose(0, 1)
    return out

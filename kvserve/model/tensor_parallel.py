"""Tensor parallelism: a model's weights split across ranks, Megatron-style.

Each rank holds 1/N of the attention heads (and of the KV heads; with fewer KV heads
than ranks, the ranks that share one hold a copy) and 1/N of the MLP's intermediate
units: q/k/v and gate/up are split by output (columns), o_proj and down_proj by input
(rows), so each rank's attention and MLP give partial sums that one all-reduce each
completes. The embedding and the LM head are split by vocabulary: a rank looks up the
tokens in its range (zeros elsewhere, then an all-reduce) and computes the logits of
its range (then an all-gather). A bias after a row split is kept on rank 0 only, so
the all-reduce adds it once.

:func:`shard_model` does it in place on a model loaded whole, before its layers are
configured (packed weights are made from the shards).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TensorParallelGroup:
    """This process's place among the ranks, and the collectives between them (a gloo
    process group of its own: no torch.distributed global state)."""

    rank: int
    size: int
    group: object  # torch.distributed.ProcessGroupGloo
    shm: object = None  # a SharedMemoryGroup among ranks on this machine, if any
    use_shm: bool = False  # all-reduce through it (chosen by measurement: choose_all_reduce)
    seconds: float = 0.0  # spent in collectives, cumulative (what tensor parallelism costs)
    calls: int = 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        if self.use_shm:
            self.shm.all_reduce_(x)
        else:
            self.group.allreduce([x]).wait()
        self._count(start)
        return x

    def choose_all_reduce(self, width: int, dtype: torch.dtype, rounds: int = 50
                          ) -> dict[str, float]:
        """Time a decode step's all-reduce ([1, width]) through gloo and through shared
        memory; keep the faster (rank 0 decides for all). Every rank must call it."""
        if self.shm is None:
            return {}
        x = torch.ones(1, width, dtype=dtype)
        times = {}
        for name, shm in (("gloo", False), ("shared memory", True)):
            self.use_shm = shm
            for _ in range(5):
                self.all_reduce_(x)
            start = time.perf_counter()
            for _ in range(rounds):
                self.all_reduce_(x)
            times[name] = (time.perf_counter() - start) / rounds
        choice = torch.tensor([int(times["shared memory"] < times["gloo"])])
        self.group.broadcast(choice, 0).wait()
        self.use_shm = bool(choice.item())
        self.seconds, self.calls = 0.0, 0
        return times

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` (equal shapes) side by side along the last dimension."""
        start = time.perf_counter()
        if self.use_shm and self.shm.fits(x):
            out = self.shm.all_gather_last(x)
        else:
            x = x.contiguous()
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.group.allgather([parts], [x]).wait()
            out = torch.cat(parts, dim=-1)
        self._count(start)
        return out

    def _count(self, start: float) -> None:
        self.seconds += time.perf_counter() - start
        self.calls += 1


def check_shardable(arch, size: int) -> None:
    """Refuse a tensor_parallel_size the model's shape cannot be split by, and models whose
    layers are not split yet (mixtures of experts, q/k norms over whole projections)."""
    if size > 1 and (arch.num_experts or arch.qk_norm == "projection"):
        what = "mixture-of-experts" if arch.num_experts else "q/k-norm-over-projection"
        raise ValueError(f"tensor_parallel_size {size}: {arch.architecture}'s {what} layers "
                         "are not split across ranks yet; run it with tensor_parallel_size 1")
    problems = []
    if arch.num_heads % size:
        problems.append(f"{arch.num_heads} attention heads")
    if arch.num_kv_heads % size and size % arch.num_kv_heads:
        problems.append(f"{arch.num_kv_heads} KV heads (nor the reverse)")
    if arch.intermediate_size % size:
        problems.append(f"an MLP of {arch.intermediate_size} units")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide "
                         f"{' and '.join(problems)} of {arch.architecture}")


def rank_arch(arch, tp: TensorParallelGroup):
    """``arch`` as one rank sees it: its heads and KV heads (its pool's shape)."""
    import dataclasses
    _, _, heads, kv_heads = _head_ranges(tp, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    return dataclasses.replace(arch, num_heads=heads, num_kv_heads=kv_heads)


def _set(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def _split_output(linear: nn.Linear, pieces: list[tuple[int, int]]) -> None:
    """Keep the output rows in ``pieces`` ((start, stop) ranges), in order."""
    w = torch.cat([linear.weight.data[a:b] for a, b in pieces])
    b = (torch.cat([linear.bias.data[a:b] for a, b in pieces])
         if linear.bias is not None else None)
    _set(linear, w, b)


def _split_input(linear: nn.Linear, start: int, stop: int, rank: int) -> None:
    w = linear.weight.data[:, start:stop]
    b = linear.bias.data if linear.bias is not None else None
    if b is not None and rank != 0:
        b = torch.zeros_like(b)
    _set(linear, w, b)


def _head_ranges(tp: TensorParallelGroup, heads: int, kv_heads: int, head_dim: int
                 ) -> tuple[tuple[int, int], tuple[int, int], int, int]:
    """(this rank's q rows, its kv rows within k (or v), its heads, its kv heads)."""
    local = heads // tp.size
    q = (tp.rank * local * head_dim, (tp.rank + 1) * local * head_dim)
    if kv_heads >= tp.size:
        local_kv = kv_heads // tp.size
        first = tp.rank * local_kv
    else:  # ranks share a kv head: each holds a copy of its own
        local_kv, first = 1, tp.rank * kv_heads // tp.size
    kv = (first * head_dim, (first + local_kv) * head_dim)
    return q, kv, local, local_kv


def _shard_llama_attention(attn, tp: TensorParallelGroup) -> None:
    (q0, q1), (k0, k1), heads, kv_heads = _head_ranges(tp, attn.num_heads, attn.num_kv_heads,
                                                       attn.head_dim)
    q_size, kv_size = attn.q_size, attn.kv_size
    _split_output(attn.qkv_proj, [(q0, q1), (q_size + k0, q_size + k1),
                                  (q_size + kv_size + k0, q_size + kv_size + k1)])
    _split_input(attn.o_proj, q0, q1, tp.rank)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * attn.head_dim, kv_heads * attn.head_dim
    attn.tp = tp


def _shard_gated_mlp(mlp, tp: TensorParallelGroup) -> None:
    part = mlp.inter // tp.size
    a, b = tp.rank * part, (tp.rank + 1) * part
    _split_output(mlp.gate_up_proj, [(a, b), (mlp.inter + a, mlp.inter + b)])
    _split_input(mlp.down_proj, a, b, tp.rank)
    mlp.inter = part
    mlp.tp = tp


def _shard_gpt2_attention(attn, tp: TensorParallelGroup) -> None:
    hidden = attn.num_heads * attn.head_dim
    (q0, q1), _, heads, _ = _head_ranges(tp, attn.num_heads, attn.num_heads, attn.head_dim)
    _split_output(attn.c_attn, [(q0, q1), (hidden + q0, hidden + q1),
                                (2 * hidden + q0, 2 * hidden + q1)])
    _split_input(attn.c_proj, q0, q1, tp.rank)
    attn.num_heads = heads
    attn.tp = tp


def _shard_gpt2_mlp(mlp, tp: TensorParallelGroup) -> None:
    inter = mlp.c_fc.out_features
    part = inter // tp.size
    a, b = tp.rank * part, (tp.rank + 1) * part
    _split_output(mlp.c_fc, [(a, b)])
    _split_input(mlp.c_proj, a, b, tp.rank)
    mlp.tp = tp


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + shard) of the embedding (zero-padded past the vocabulary):
    tokens outside them give zeros, and the all-reduce fills them in."""

    def __init__(self, full: torch.Tensor, tp: TensorParallelGroup) -> None:
        super().__init__()
        vocab = full.shape[0]
        self.shard = -(-vocab // tp.size)
        self.start = tp.rank * self.shard
        rows = full[self.start:self.start + self.shard]
        if rows.shape[0] < self.shard:
            rows = torch.cat([rows, rows.new_zeros(self.shard - rows.shape[0], rows.shape[1])])
        self.weight = nn.Parameter(rows.contiguous(), requires_grad=False)
        self.tp = tp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce_(out)


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary rows; logits all-gathered, padding cut."""

    def __init__(self, head: nn.Linear, embedding: VocabParallelEmbedding | None,
                 vocab: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.vocab, self.tp = vocab, tp
        if embedding is not None:  # tied: the embedding's shard is the head's
            weight = embedding.weight
        else:
            weight = VocabParallelEmbedding(head.weight.data, tp).weight
        self.linear = type(head)(weight.shape[1], weight.shape[0], bias=False)
        self.linear.weight = weight

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.linear(hidden))[..., :self.vocab]


def shard_model(model: nn.Module, tp: TensorParallelGroup) -> None:
    """Split ``model`` (Llama family or GPT-2, loaded whole) into this rank's share."""
    from kvserve.model.decoder import Attention, GatedMLP
    from kvserve.model.gpt2 import GPT2Attention, GPT2LMHeadModel, GPT2MLP

    for module in list(model.modules()):
        if isinstance(module, Attention):
            _shard_llama_attention(module, tp)
        elif isinstance(module, GatedMLP):
            _shard_gated_mlp(module, tp)
        elif isinstance(module, GPT2Attention):
            _shard_gpt2_attention(module, tp)
        elif isinstance(module, GPT2MLP):
            _shard_gpt2_mlp(module, tp)
    cfg = model.config
    body = model.transformer if isinstance(model, GPT2LMHeadModel) else model.model
    name = "wte" if isinstance(model, GPT2LMHeadModel) else "embed_tokens"
    embedding = VocabParallelEmbedding(getattr(body, name).weight.data, tp)
    setattr(body, name, embedding)
    model.lm_head = VocabParallelHead(model.lm_head, embedding if cfg.tie_word_embeddings
                                      else None, cfg.vocab_size, tp)

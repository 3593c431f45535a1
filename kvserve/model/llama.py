"""The Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM.

Differences between the three are configuration (GQA, q/k/v bias, sliding window,
rope scaling), so one implementation serves them. q/k/v and gate/up projections are
fused into single GEMMs at load time.
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import AttentionMetadata, KVCache, paged_attention
from kvserve.model.config import ArchConfig
from kvserve.model.layers import GatedActivation, Linear, RMSNorm, RotaryEmbedding, \
    in_row_chunks


class LlamaAttention(nn.Module):
    step_part = "attention"  # for the step profiler
    tp = None  # TensorParallelGroup when sharded: o_proj gives this rank's partial sum

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                cache: KVCache, meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        rotated = rotary.rotate_qkv_(positions, qkv, self.num_heads, self.num_kv_heads,
                                     self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not rotated:
            q, k = rotary(positions, q, k)
        out = self.o_proj(paged_attention(q, k, v, cache, meta, self.scale, out_rows)
                          .reshape(-1, self.q_size))
        return out if self.tp is None else self.tp.all_reduce_(out)


class LlamaMLP(nn.Module):
    tp = None  # TensorParallelGroup when sharded: down_proj gives a partial sum

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = GatedActivation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = in_row_chunks(self._forward, x, 2 * self.inter)
        return out if self.tp is None else self.tp.all_reduce_(out)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, residual, positions, rotary, cache, meta, out_rows=None):
        """x: the previous layer's MLP output, or the embeddings at the first layer
        (residual None); residual: the hidden state before it. Returns this layer's MLP
        output and the hidden state before it; each residual add is fused into the norm
        after it (the sums are the same as adding, then norming)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, cache, meta, out_rows)
        if out_rows is not None:
            residual = residual[out_rows]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(tokens, positions, caches, meta, out_rows) -> final hidden states [T, hidden],
    or [len(out_rows), hidden] for the rows ``out_rows``: the last layer then computes only
    the K/V of the other rows, whose outputs nothing reads."""

    # checkpoint name fragment -> (our parameter fragment, shard index)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }
    transposed_params: tuple[str, ...] = ()

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)

    def shard_sizes(self, param_name: str) -> list[int]:
        cfg = self.config
        if ".qkv_proj." in param_name:
            return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        return [cfg.intermediate_size] * 2

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                meta: AttentionMetadata, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        x, residual = self.model.embed_tokens(tokens), None
        for i, (layer, cache) in enumerate(zip(self.model.layers, caches)):
            last = i == len(caches) - 1
            x, residual = layer(x, residual, positions, self.rotary, cache, meta,
                                out_rows if last else None)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

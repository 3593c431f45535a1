"""GPT2LMHeadModel: learned positions, LayerNorm, fused c_attn, Conv1D weights."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import AttentionMetadata, KVCache, paged_attention
from kvserve.model.config import ArchConfig, gpt2_config
from kvserve.model.layers import Linear, activation, embedding, in_row_chunks


class GPT2Attention(nn.Module):
    step_part = "attention"  # for the step profiler
    tp = None  # TensorParallelGroup when sharded: c_proj gives this rank's partial sum

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.c_attn = Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = Linear(cfg.hidden_size, cfg.hidden_size)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.c_attn(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        out = paged_attention(q, k, v, cache, meta, self.scale, out_rows)
        out = self.c_proj(out.reshape(-1, self.num_heads * self.head_dim))
        return out if self.tp is None else self.tp.all_reduce_(out)


class GPT2MLP(nn.Module):
    tp = None  # TensorParallelGroup when sharded: c_proj gives a partial sum

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.c_fc = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.c_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.c_fc.lora
        out = in_row_chunks(self._forward, x, self.c_fc.out_features,
                            lora.rows if lora is not None else None)
        return out if self.tp is None else self.tp.all_reduce_(out)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x, cache, meta, out_rows=None):
        attn = self.attn(self.ln_1(x), cache, meta, out_rows)
        x = (x if out_rows is None else x[out_rows]) + attn
        return x + self.mlp(self.ln_2(x))


class GPT2Transformer(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.wte = embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class GPT2LMHeadModel(nn.Module):
    notes = "learned positions, biases, tied embeddings"
    stacked_params: dict[str, tuple[str, int]] = {}
    # HF stores these as Conv1D ([in, out]); nn.Linear wants [out, in].
    transposed_params = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Transformer(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        return gpt2_config(cfg)

    def checkpoint_name(self, name: str) -> str:
        """Old GPT-2 checkpoints omit the ``transformer.`` prefix."""
        if name.startswith(("transformer.", "lm_head.")):
            return name
        return "transformer." + name

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                meta: AttentionMetadata, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward: ``out_rows`` limits the last layer's outputs."""
        x = self.transformer.wte(tokens) + self.transformer.wpe(positions)
        for i, (block, cache) in enumerate(zip(self.transformer.h, caches)):
            x = block(x, cache, meta, out_rows if i == len(caches) - 1 else None)
        return self.transformer.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

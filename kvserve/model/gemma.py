"""Gemma 2 and Gemma 3 (text): norms before and after each block, RMSNorm weights
stored as offsets from 1, embeddings scaled by sqrt(hidden), local (windowed) and global
layers alternating, Gemma 2's soft-capped attention scores and logits, Gemma 3's q/k
norms and its local layers' own rope base."""
from __future__ import annotations

import torch

from kvserve.model.config import ArchConfig, RopeConfig, llama_like_config, rope_config
from kvserve.model.decoder import CausalLM, SandwichDecoderLayer
from kvserve.model.layers import RMSNorm


def gemma_config(name: str, cfg: dict, window_pattern: int, **fields) -> ArchConfig:
    """Every ``window_pattern``-th layer global, the others windowed, unless the config
    lists ``layer_types``."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{name} with use_bidirectional_attention is an encoder; kvserve "
                         "runs causal decoders only")
    layers = cfg["num_hidden_layers"]
    pattern = cfg.get("sliding_window_pattern", window_pattern)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern
                                       else "full_attention" for i in range(layers)]
    window = cfg.get("sliding_window") or 0
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return llama_like_config(
        name, cfg, hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act")
        or "gelu_pytorch_tanh", tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        sliding_window=None,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        attn_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"), scale_embeddings=True, **fields)


class Gemma2ForCausalLM(CausalLM):
    notes = ("soft-capped scores and logits, norms before and after each block, "
             "alternating local and global layers")
    decoder_layer = SandwichDecoderLayer

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        return gemma_config(name, cfg, window_pattern=2)

    @torch.no_grad()
    def after_load(self) -> None:
        """Gemma's norms scale by (1 + weight), computed in float32: kept as that sum."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(1.0)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    notes = ("Gemma 3 text: q/k norms per head, a rope base of its own for the local "
             "layers, five local layers to one global")

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        params = cfg.get("rope_parameters") or {}
        if "full_attention" in params:  # one rope per layer type (transformers 5)
            global_rope = rope_config({**cfg, "rope_parameters": params["full_attention"],
                                       "rope_scaling": None})
            local_rope = rope_config({**cfg, "rope_parameters": params["sliding_attention"],
                                      "rope_scaling": None})
        else:
            global_rope = rope_config(cfg)
            local_rope = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
        return gemma_config(name, cfg, window_pattern=6, qk_norm="head", rope=global_rope,
                            local_rope=local_rope)

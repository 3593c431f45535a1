"""Phi-3 and Phi-4-mini: the Llama layers, their checkpoints already fused (``qkv_proj``,
``gate_up_proj``), a sliding window where the config has one, partial rotary, and the
``longrope`` scaling their long-context versions ship."""
from __future__ import annotations

from kvserve.model.config import ArchConfig, llama_like_config
from kvserve.model.decoder import CausalLM


class Phi3ForCausalLM(CausalLM):
    notes = "fused qkv and gate/up weights, longrope, partial rotary, sliding window"

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rotary = int(head_dim * cfg.get("partial_rotary_factor", 1.0))
        return llama_like_config(name, cfg, window_by_default=True,
                                 rotary_dim=rotary if rotary != head_dim else None)

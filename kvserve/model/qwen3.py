"""Qwen3: the Llama layers with each head's q and k RMSNormed before rotary."""
from __future__ import annotations

from kvserve.model.config import ArchConfig, llama_like_config
from kvserve.model.decoder import CausalLM


class Qwen3ForCausalLM(CausalLM):
    notes = "q/k RMSNorm per head; sliding window when the config enables it"

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        return llama_like_config(name, cfg, qk_norm="head")

"""The Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM.

Differences between the three are configuration (GQA, q/k/v bias, sliding window,
rope scaling), so one implementation serves them: the shared decoder layers
(``decoder.py``), q/k/v and gate/up projections fused into single GEMMs at load time.
"""
from __future__ import annotations

from kvserve.model.config import ArchConfig, llama_like_config
from kvserve.model.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    notes = "grouped-query attention, llama3 and linear rope scaling, tied embeddings"


class MistralForCausalLM(LlamaForCausalLM):
    notes = "sliding-window attention"

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        return llama_like_config(name, cfg, window_by_default=True)


class Qwen2ForCausalLM(LlamaForCausalLM):
    notes = "qkv bias; sliding window when the config enables it"

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        return llama_like_config(name, cfg, qkv_bias=True)

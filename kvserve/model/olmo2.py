"""OLMo 2: norms after attention and after the MLP instead of before them, and q and k
RMSNormed over their whole projections."""
from __future__ import annotations

from kvserve.model.config import ArchConfig, llama_like_config
from kvserve.model.decoder import CausalLM, PostNormDecoderLayer


class Olmo2ForCausalLM(CausalLM):
    notes = "norms after attention and MLP; q/k RMSNorm over the projections"
    decoder_layer = PostNormDecoderLayer

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        return llama_like_config(name, cfg, qk_norm="projection")

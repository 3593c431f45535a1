"""Mixture-of-experts models: Mixtral, Qwen2-MoE (with a shared expert) and Qwen3-MoE
(Qwen3's attention), their MLPs the grouped experts of ``moe.py``."""
from __future__ import annotations

from torch import nn

from kvserve.model.config import ArchConfig, llama_like_config
from kvserve.model.decoder import CausalLM, DecoderLayer, GatedMLP
from kvserve.model.moe import SparseMoE


def moe_or_dense(cfg: ArchConfig, layer: int) -> nn.Module:
    return GatedMLP(cfg) if layer in cfg.dense_layers else SparseMoE(cfg)


def moe_layer(cfg: ArchConfig, index: int) -> nn.Module:
    return DecoderLayer(cfg, index, moe_or_dense)


class MixtralForCausalLM(CausalLM):
    notes = "top-k routed experts (grouped: one GEMM per active expert), sliding window"
    decoder_layer = moe_layer
    # experts' w1 (gate) and w3 (up) fused, w2 the down projection; the MoE is the MLP
    stacked_params = {**CausalLM.stacked_params,
                      ".w1.": (".gate_up_proj.", 0), ".w3.": (".gate_up_proj.", 1)}

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        return llama_like_config(name, cfg, window_by_default=True,
                                 num_experts=cfg["num_local_experts"],
                                 num_experts_per_tok=cfg["num_experts_per_tok"],
                                 moe_intermediate_size=cfg["intermediate_size"])

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.").replace(".w2.", ".down_proj.")


def _qwen_moe_config(name: str, cfg: dict, **fields) -> ArchConfig:
    """Qwen-MoE's keys: which layers are dense (``mlp_only_layers``, and all but every
    ``decoder_sparse_step``-th), the experts' sizes and routing."""
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = tuple(i for i in range(cfg["num_hidden_layers"])
                  if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step)
    return llama_like_config(
        name, cfg, num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense, **fields)


class Qwen2MoeForCausalLM(CausalLM):
    notes = "routed experts and a gated shared expert; qkv bias"
    decoder_layer = moe_layer

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        return _qwen_moe_config(name, cfg, qkv_bias=bool(cfg.get("qkv_bias", True)),
                                shared_expert_intermediate_size=cfg.get(
                                    "shared_expert_intermediate_size", 0))


class Qwen3MoeForCausalLM(CausalLM):
    notes = "routed experts, `norm_topk_prob`; q/k RMSNorm per head"
    decoder_layer = moe_layer

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        return _qwen_moe_config(name, cfg, qk_norm="head")

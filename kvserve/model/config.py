"""ArchConfig: the parts of a Hugging Face config.json the engine uses, normalised."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ArchConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {model_dir} has no config.json")
        return cls.from_dict(json.loads(path.read_text()), source=str(path))

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> ArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if arch == "GPT2LMHeadModel":
            return _gpt2_config(cfg)
        return _llama_like_config(arch, cfg)


def _eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _rope(cfg: dict) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3")
    return RopeConfig(
        theta=float(theta), rope_type=rope_type, factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"))


def _llama_like_config(arch: str, cfg: dict) -> ArchConfig:
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    sliding = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        sliding = None
    return ArchConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        norm_eps=cfg.get("rms_norm_eps", 1e-6), hidden_act=cfg.get("hidden_act", "silu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=sliding, rope=_rope(cfg),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos_ids(cfg))


def _gpt2_config(cfg: dict) -> ArchConfig:
    hidden = cfg["n_embd"]
    heads = cfg["n_head"]
    return ArchConfig(
        architecture="GPT2LMHeadModel", vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=cfg["n_layer"], num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=cfg.get("n_inner") or 4 * hidden,
        max_position_embeddings=cfg.get("n_positions", 1024),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        hidden_act=cfg.get("activation_function", "gelu_new"),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True), qkv_bias=True, o_bias=True,
        mlp_bias=True, torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos_ids(cfg))

"""ArchConfig: the parts of a Hugging Face config.json the engine uses, normalised."""
from __future__ import annotations

from dataclasses import dataclass, field

@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    short_factor: tuple[float, ...] = ()  # longrope: per frequency, within the original
    long_factor: tuple[float, ...] = ()   # length, and beyond it
    attention_factor: float | None = None  # longrope, yarn: cos/sin scaled (None: derived)
    beta_fast: float = 32.0               # yarn's ramp between interpolation and
    beta_slow: float = 1.0                # extrapolation
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


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
    qk_norm: str | None = None        # head: RMSNorm per head (Qwen3); projection: OLMo 2
    rotary_dim: int | None = None     # partial rotary (Phi-4-mini); None: head_dim
    num_experts: int = 0              # mixture of experts: routed experts per layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True       # the chosen experts' weights renormalised to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert
    dense_layers: tuple[int, ...] = ()  # layers of a MoE model with a dense MLP
    layer_windows: tuple[int, ...] = ()  # each layer's window (0: none); (): sliding_window
    local_rope: RopeConfig | None = None  # the windowed layers' own rope (Gemma 3)
    attn_scale: float | None = None      # the scores' scale (None: head_dim ** -0.5)
    attn_softcap: float | None = None    # scores capped as cap * tanh(score / cap)
    # StreamingLLM: with a sliding window the engine imposes, the first tokens stay visible
    attention_sinks: int = 0
    final_softcap: float | None = None   # the logits likewise
    scale_embeddings: bool = False       # embeddings times sqrt(hidden_size) (Gemma)


def eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def rope_config(cfg: dict) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: "
                         f"{', '.join(ROPE_TYPES)}")
    original = (params.get("original_max_position_embeddings")
                or cfg.get("original_max_position_embeddings"))
    factor = params.get("factor")
    if factor is None and rope_type in ("yarn", "longrope") and original:
        factor = cfg.get("max_position_embeddings", 2048) / original
    if rope_type == "dynamic":  # NTK by the sequence's length past the model's own
        trained = cfg.get("max_position_embeddings", 2048)
        if original not in (None, trained):
            raise ValueError(f"dynamic rope with original_max_position_embeddings {original} "
                             f"other than max_position_embeddings {trained} is not supported")
        original = trained
    optional = {k: float(params[k]) for k in ("attention_factor", "mscale", "mscale_all_dim")
                if params.get(k) is not None}
    return RopeConfig(
        theta=float(theta), rope_type=rope_type, factor=float(factor or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original or (
            cfg.get("max_position_embeddings") if rope_type in ("yarn", "longrope")
            else None),
        short_factor=tuple(params.get("short_factor") or ()),
        long_factor=tuple(params.get("long_factor") or ()),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)), **optional)


def llama_like_config(arch: str, cfg: dict, window_by_default: bool = False,
                      **fields) -> ArchConfig:
    """The config of a Llama-like architecture ``arch``; ``fields`` set or override
    what its own keys say. ``sliding_window`` applies where ``use_sliding_window`` says so
    (Qwen's configs ship a window that is off), by default where ``window_by_default``
    (Mistral's)."""
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    sliding = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window", window_by_default):
        sliding = None
    values = dict(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        norm_eps=cfg.get("rms_norm_eps", 1e-6), hidden_act=cfg.get("hidden_act", "silu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=sliding, rope=rope_config(cfg),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg))
    if values["rope"].rope_type == "dynamic":  # it serves sequences factor times longer
        values["max_position_embeddings"] = int(values["max_position_embeddings"]
                                                * values["rope"].factor)
    values.update(fields)
    return ArchConfig(**values)


def gpt2_config(cfg: dict) -> ArchConfig:
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
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg))

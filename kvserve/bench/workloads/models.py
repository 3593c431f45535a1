"""Deterministic random-weight bench models (``kvserve bench make-model``).

The Llama shapes are those of ``shared/BENCHMARKS.md``, and ``bench-1b`` / ``bench-8b``
Llama-3.2-1B's and Llama-3.1-8B's (their 128k vocabulary too, the tokenizer's ids padded
with unused ones); ``bench-gemma2-100m`` has
Gemma 2's layout (local layers with a 4096-token window alternating with global ones,
soft-capped scores and logits) at bench-100m's width, and ``bench-moe-150m`` Qwen3-MoE's
(16 experts, 2 routed per token). Weights come from ``torch.manual_seed(0)`` and
transformers' own initialisation, so every machine builds the same model. The embedded default model's tokenizer is copied in so the
bench model can be served and prompted with text as well as token ids.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

__all__ = [
    "BENCH_MODELS",
    "BenchModelSpec",
    "make_bench_model",
    "model_vocab",
    "TOKENIZER_FILES",
]

# Files copied from the tokenizer directory (those that exist).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class BenchModelSpec:
    """Shape of a bench model: Llama's, or (``architecture``) Gemma 2's or Qwen3-MoE's."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    architecture: str = "llama"  # llama, gemma2 or qwen3_moe
    sliding_window: int = 0      # gemma2: its local layers' window
    num_experts: int = 0         # qwen3_moe: experts per layer, and routed per token
    experts_per_token: int = 0
    tied_embeddings: bool = False  # the LM head is the embedding table

    def num_params(self, active: bool = False) -> int:
        """Total parameter count (untied embeddings, no biases); ``active``: those one
        token's forward pass reads (a MoE layer's routed experts only)."""
        head_dim = self.hidden_size // self.num_heads
        q_o = 2 * self.hidden_size * self.num_heads * head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        if self.num_experts:
            experts = self.experts_per_token if active else self.num_experts
            mlp = experts * mlp + self.hidden_size * self.num_experts  # and the router
        layer = q_o + k_v + mlp + norms
        # the output head; the embedding table (its own unless tied), of which a token
        # reads one row
        tables = 1 if active or self.tied_embeddings else 2
        embeddings = tables * self.vocab_size * self.hidden_size
        return self.num_layers * layer + embeddings + self.hidden_size


BENCH_MODELS: Mapping[str, BenchModelSpec] = MappingProxyType(
    {
        "bench-30m": BenchModelSpec(512, 8, 8, 4, 1536),
        "bench-100m": BenchModelSpec(768, 12, 12, 4, 2048),
        "bench-gemma2-100m": BenchModelSpec(768, 12, 12, 4, 2048, max_position_embeddings=8192,
                                            architecture="gemma2", sliding_window=4096),
        "bench-moe-150m": BenchModelSpec(512, 8, 8, 4, 768, architecture="qwen3_moe",
                                         num_experts=16, experts_per_token=2),
        "bench-1b": BenchModelSpec(2048, 16, 32, 8, 8192, vocab_size=128256,
                                   max_position_embeddings=8192, rope_theta=500000.0,
                                   tied_embeddings=True),
        "bench-8b": BenchModelSpec(4096, 32, 32, 8, 14336, vocab_size=128256,
                                   max_position_embeddings=8192, rope_theta=500000.0),
    }
)


def _token_content(value: Any) -> str | None:
    """The token string of a tokenizer_config entry (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_ids_from_tokenizer_dir(tokenizer_dir: Path) -> dict[str, int | None]:
    """bos/eos/pad ids named by tokenizer_config.json, resolved through tokenizer.json."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    cfg_path = tokenizer_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    model_cfg_path = tokenizer_dir / "config.json"
    model_cfg = json.loads(model_cfg_path.read_text()) if model_cfg_path.exists() else {}
    ids: dict[str, int | None] = {}
    for kind in ("bos", "eos", "pad"):
        content = _token_content(cfg.get(f"{kind}_token"))
        tid = tok.token_to_id(content) if content else None
        if tid is None:
            fallback = model_cfg.get(f"{kind}_token_id")
            tid = fallback[0] if isinstance(fallback, list) and fallback else fallback
        ids[kind] = tid
    ids["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    return ids


def _resolve_spec(name_or_spec: str | BenchModelSpec) -> BenchModelSpec:
    if isinstance(name_or_spec, BenchModelSpec):
        return name_or_spec
    if name_or_spec not in BENCH_MODELS:
        known = ", ".join(sorted(BENCH_MODELS))
        raise ValueError(f"unknown bench model {name_or_spec!r}; known: {known}")
    return BENCH_MODELS[name_or_spec]


def make_bench_model(
    name: str | BenchModelSpec,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    copy_tokenizer: bool = True,
) -> Path:
    """Build a bench model (a name from :data:`BENCH_MODELS` or a custom spec) in ``out_dir``.

    ``tokenizer_dir`` defaults to the embedded default model's directory; its
    tokenizer files are copied and its bos/eos ids written into the config.
    ``copy_tokenizer=False`` builds weights only (for tests without a tokenizer).
    """
    import torch
    from transformers import AutoModelForCausalLM

    spec = _resolve_spec(name)
    out = Path(out_dir)
    special: dict[str, int | None] = {"bos": None, "eos": None, "pad": None}
    tok_dir: Path | None = None
    if copy_tokenizer:
        if tokenizer_dir is None:
            from kvserve.default_model import default_model_dir

            tokenizer_dir = default_model_dir()
        tok_dir = Path(tokenizer_dir)
        if not (tok_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {tok_dir}: the bench model copies its tokenizer from "
                "there (the embedded default model may not be trained yet); pass "
                "tokenizer_dir=... / --tokenizer-dir DIR"
            )
        special = _special_ids_from_tokenizer_dir(tok_dir)
        if special["vocab_size"] > spec.vocab_size:
            raise ValueError(
                f"tokenizer has {special['vocab_size']} tokens, more than the model's "
                f"vocab_size {spec.vocab_size}"
            )

    float32_bytes = 4 * spec.num_params()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if float32_bytes > memory // 2:
        raise ValueError(f"{float32_bytes / 2**30:.0f} GiB of float32 weights would not fit "
                         f"this machine's {memory / 2**30:.0f} GiB: write the model as a GGUF "
                         "file (--format gguf-bf16, gguf-q8_0, gguf-q4_k_m or gguf-q5_k_m), which never "
                         "holds a float32 copy")
    config = _hf_config(spec, special)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if tok_dir is not None:
        for fname in TOKENIZER_FILES:
            src = tok_dir / fname
            if src.is_file():
                shutil.copyfile(src, out / fname)
    (out / "bench_model.json").write_text(
        json.dumps({"name": name if isinstance(name, str) else "custom", **asdict(spec)}, indent=2)
    )
    return out


def _hf_config(spec: BenchModelSpec, special: dict[str, int | None]):
    import transformers as tf

    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=spec.tied_embeddings,
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"])
    head_dim = spec.hidden_size // spec.num_heads
    if spec.architecture == "llama":
        return tf.LlamaConfig(**common)
    if spec.architecture == "gemma2":
        return tf.Gemma2Config(**common, head_dim=head_dim, sliding_window=spec.sliding_window,
                               query_pre_attn_scalar=head_dim)
    if spec.architecture == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=head_dim, num_experts=spec.num_experts,
                                 num_experts_per_tok=spec.experts_per_token,
                                 moe_intermediate_size=spec.intermediate_size,
                                 norm_topk_prob=True)
    raise ValueError(f"bench model architecture {spec.architecture!r}: one of llama, gemma2, "
                     "qwen3_moe")


def model_vocab(model_dir: str | Path) -> tuple[int, list[int]]:
    """``(vocab_size, special_token_ids)`` of a model directory in HF layout.

    Special ids are the tokenizer's special added tokens plus the config's
    bos/eos/pad ids; workloads draw prompt tokens from everything else.
    """
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    vocab_size = int(cfg["vocab_size"])
    special: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        val = cfg.get(key)
        for v in val if isinstance(val, list) else [val]:
            if isinstance(v, int):
                special.add(v)
    tok_path = d / "tokenizer.json"
    if tok_path.is_file():
        from tokenizers import Tokenizer

        # Ids past the tokenizer's vocabulary cannot be detokenized: stay below it.
        vocab_size = min(vocab_size, Tokenizer.from_file(str(tok_path)).get_vocab_size(True))
        tok = json.loads(tok_path.read_text())
        for added in tok.get("added_tokens", []):
            if added.get("special", False):
                special.add(int(added["id"]))
    return vocab_size, sorted(i for i in special if 0 <= i < vocab_size)

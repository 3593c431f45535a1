"""The model layer's side of the engine config: the checkpoint directory read into a
:class:`~kvserve.config.model.ModelConfig`, and the settings only this layer can check
(its quantization methods, the architectures it loads)."""
from __future__ import annotations

from pathlib import Path

from kvserve.config.model import GGUF_ACTIVATIONS, ModelConfig
from kvserve.config.validate import choice
from kvserve.default_model import default_model_dir
from kvserve.model.compressed import read_compressed_config
from kvserve.model.gguf import is_gguf, prepare_gguf
from kvserve.model.registry import read_arch_config
from kvserve.model.generation_config import sampling_defaults
from kvserve.model.loader import keeps_16bit_weights, resolve_dtype
from kvserve.model.quantization import check_quantization


def resolve_model_dir(model: str | None) -> Path:
    """The checkpoint directory; None is the embedded default model; a GGUF file becomes
    the directory made for it (``model/gguf/checkpoint.py``)."""
    if model is None:
        model = default_model_dir()
    path = Path(model)
    if is_gguf(path):
        return prepare_gguf(path)
    if not path.is_dir():
        what = "is neither a directory nor a GGUF file" if path.exists() else "does not exist"
        raise FileNotFoundError(f"model {model!r} {what} (kvserve loads local directories in "
                                "Hugging Face layout and GGUF files; no hub downloads)")
    return path


# rotations that depend on the position alone: attention then depends on distances only
RELATIVE_ROPES = ("default", "linear", "llama3", "yarn")


def streaming_arch(arch, window: int | None, sinks: int, max_model_len: int | None):
    """StreamingLLM on a model without a window of its own: each token attends to the
    first ``sinks`` tokens and the last ``window``, the sinks as if they sat just before
    the window, so no distance exceeds ``sinks + window``, which must be within the
    trained positions; the model then serves sequences longer than those
    (``max_model_len``)."""
    import dataclasses

    if window is None:
        raise ValueError("attention_sinks needs attention_window: the sinks are kept beside "
                         "a sliding window")
    if window < 1 or sinks < 0:
        raise ValueError(f"attention_window must be >= 1 and attention_sinks >= 0, got "
                         f"{window} and {sinks}")
    if arch.sliding_window or any(arch.layer_windows):
        raise ValueError(f"{arch.architecture} has sliding windows of its own; "
                         "attention_window is for models without one")
    if arch.rope.rope_type not in RELATIVE_ROPES:
        raise ValueError(f"attention_window needs a rope whose rotation depends on the "
                         f"position alone ({', '.join(RELATIVE_ROPES)}); this model's is "
                         f"{arch.rope.rope_type!r}")
    if sinks and (arch.rotary_dim or arch.head_dim) != arch.head_dim:
        raise ValueError("attention_sinks needs a rotary embedding over the whole head")
    if window + sinks > arch.max_position_embeddings:
        raise ValueError(f"attention_window + attention_sinks ({window} + {sinks}) exceeds the "
                         f"model's {arch.max_position_embeddings} positions")
    return dataclasses.replace(
        arch, sliding_window=window, attention_sinks=sinks,
        max_position_embeddings=max(arch.max_position_embeddings, max_model_len or 0))


def check_model_settings(dtype: str, max_model_len: int | None,
                         quantization: str | None) -> None:
    """The model settings' rules that need no checkpoint."""
    ModelConfig.check(dtype, max_model_len)
    check_quantization(quantization)


def create_model_config(model: str | None, *, dtype: str, max_model_len: int | None,
                        quantization: str | None, seed: int, device: str = "cpu",
                        generation_config: str = "auto", attention_window: int | None = None,
                        attention_sinks: int = 0, runner: str = "auto",
                        gguf_activations: str = "int8", tokenizer: str | None = None
                        ) -> ModelConfig:
    """The model's part of the engine config; reads the directory's config.json.
    ``device``: where it computes (the resolved ``--device``), which ``dtype`` auto
    reads."""
    check_model_settings(dtype, max_model_len, quantization)
    model_dir = resolve_model_dir(model)
    arch = read_arch_config(model_dir)
    compressed = read_compressed_config(model_dir)  # refuses a quantization it cannot run
    if compressed is not None and quantization is not None:
        raise ValueError(f"{model} is a {compressed.describe()} checkpoint, computed as "
                         f"stored: --quantization {quantization} does not apply to it")
    if attention_window is not None or attention_sinks:
        arch = streaming_arch(arch, attention_window, attention_sinks, max_model_len)
    limit = arch.max_position_embeddings
    wanted = max_model_len or limit
    if wanted > limit:
        raise ValueError(f"max_model_len {wanted} exceeds the model's "
                         f"max_position_embeddings {limit}")
    ModelConfig.check(dtype, max_model_len, runner)
    choice("gguf_activations", gguf_activations, GGUF_ACTIVATIONS)
    tokenizer_dir = None
    if tokenizer is not None:
        tokenizer_dir = Path(tokenizer)
        if not (tokenizer_dir / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer {tokenizer!r} is not a directory holding a "
                             "tokenizer.json")
    return ModelConfig(model_dir, arch, resolve_dtype(dtype, arch, device), wanted,
                       quantization, gguf_activations=gguf_activations,
                       weights_16bit=keeps_16bit_weights(dtype, arch, device, quantization),
                       tokenizer_dir=tokenizer_dir, seed=seed,
                       generation_config=generation_config, runner=runner,
                       sampling_defaults=sampling_defaults(generation_config, model_dir))

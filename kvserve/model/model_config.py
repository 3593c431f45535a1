"""The model layer's side of the engine config: the checkpoint directory read into a
:class:`~kvserve.config.model.ModelConfig`, and the settings only this layer can check
(its quantization methods, the architectures it loads)."""
from __future__ import annotations

from pathlib import Path

from kvserve.config.model import ModelConfig
from kvserve.default_model import default_model_dir
from kvserve.model.registry import read_arch_config
from kvserve.model.generation_config import sampling_defaults
from kvserve.model.loader import resolve_dtype
from kvserve.model.quantization import check_quantization


def resolve_model_dir(model: str | None) -> Path:
    """The checkpoint directory; None is the embedded default model."""
    if model is None:
        model = default_model_dir()
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {model!r} does not exist (kvserve loads "
                                "local directories in Hugging Face layout; no hub downloads)")
    return path


def check_model_settings(dtype: str, max_model_len: int | None,
                         quantization: str | None) -> None:
    """The model settings' rules that need no checkpoint."""
    ModelConfig.check(dtype, max_model_len)
    check_quantization(quantization)


def create_model_config(model: str | None, *, dtype: str, max_model_len: int | None,
                        quantization: str | None, seed: int,
                        generation_config: str = "auto") -> ModelConfig:
    """The model's part of the engine config; reads the directory's config.json."""
    check_model_settings(dtype, max_model_len, quantization)
    model_dir = resolve_model_dir(model)
    arch = read_arch_config(model_dir)
    limit = arch.max_position_embeddings
    wanted = max_model_len or limit
    if wanted > limit:
        raise ValueError(f"max_model_len {wanted} exceeds the model's "
                         f"max_position_embeddings {limit}")
    return ModelConfig(model_dir, arch, resolve_dtype(dtype, arch), wanted, quantization, seed,
                       generation_config, sampling_defaults(generation_config, model_dir))

"""ModelConfig: which checkpoint, in which dtype, up to which length.

Built by :meth:`ModelConfig.create`, which reads the directory's config.json: the
fields below are resolved (``dtype`` is a torch dtype, ``max_model_len`` a number).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.config.validate import choice, optional_positive_int
from kvserve.model.config import ArchConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_METHODS = ("int8",)

if TYPE_CHECKING:
    import torch


def resolve_model_dir(model: str | None) -> Path:
    """The checkpoint directory; None is the embedded default model."""
    if model is None:
        from kvserve.default_model import default_model_dir
        model = default_model_dir()
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {model!r} does not exist (kvserve loads "
                                "local directories in Hugging Face layout; no hub downloads)")
    return path


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Path
    arch: ArchConfig
    dtype: torch.dtype
    max_model_len: int
    quantization: str | None = None
    seed: int = 0

    @staticmethod
    def check(dtype: str, max_model_len: int | None, quantization: str | None) -> None:
        """The rules that need no checkpoint (run when EngineArgs is built)."""
        choice("dtype", dtype, DTYPES)
        optional_positive_int("max_model_len", max_model_len)
        if quantization is not None:
            choice("quantization", quantization, QUANTIZATION_METHODS)

    @classmethod
    def create(cls, model: str | None, dtype: str = "auto", max_model_len: int | None = None,
               quantization: str | None = None, seed: int = 0) -> ModelConfig:
        from kvserve.model.loader import resolve_dtype

        cls.check(dtype, max_model_len, quantization)
        model_dir = resolve_model_dir(model)
        arch = ArchConfig.from_dir(model_dir)
        limit = arch.max_position_embeddings
        wanted = max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's "
                             f"max_position_embeddings {limit}")
        return cls(model_dir, arch, resolve_dtype(dtype, arch), wanted, quantization, seed)

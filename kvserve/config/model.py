"""ModelConfig: which checkpoint, in which dtype, up to which length.

Built by :func:`kvserve.model.model_config.create_model_config`, which reads the
directory's config.json: the fields below are resolved (``dtype`` is a torch dtype,
``max_model_len`` a number, ``arch`` the checkpoint's architecture).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.config.validate import choice, optional_positive_int

DTYPES = ("auto", "float32", "bfloat16", "float16")
RUNNERS = ("auto", "generate", "pooling")

if TYPE_CHECKING:
    import torch

    from kvserve.model.config import ArchConfig


GGUF_ACTIVATIONS = ("int8", "float")


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Path
    arch: ArchConfig
    dtype: torch.dtype
    max_model_len: int
    quantization: str | None = None  # a name in kvserve.model.quantization.QUANTIZATION_METHODS
    # a GGUF file's quantized layers, decode rows and prompt chunks: int8 (activations
    # rounded to int8, integer products, as llama.cpp) or float (dequantize-then-multiply's
    # sums)
    gguf_activations: str = "int8"
    # a 16-bit checkpoint's weights kept in 16 bits, computed in float32 (dtype auto on a
    # CPU without bf16 hardware: kvserve.model.loader.keeps_16bit_weights)
    weights_16bit: bool = False
    tokenizer_dir: Path | None = None  # another tokenizer's directory (None: the model's)

    @property
    def tokenizer_path(self) -> Path:
        return self.tokenizer_dir or self.model_dir
    seed: int = 0
    generation_config: str = "auto"  # where sampling defaults come from: auto | vllm | DIR
    runner: str = "auto"  # generate | pooling (embeddings) | auto: both, one scheduler
    # the SamplingParams fields that source recommends, for requests that leave them unset
    sampling_defaults: dict[str, Any] = field(default_factory=dict, hash=False)

    @staticmethod
    def check(dtype: str, max_model_len: int | None, runner: str = "auto") -> None:
        """The rules that need no checkpoint and no implementation."""
        choice("dtype", dtype, DTYPES)
        choice("runner", runner, RUNNERS)
        optional_positive_int("max_model_len", max_model_len)

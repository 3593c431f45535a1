"""The embedded default model shipped with kvserve.

``kvserve/default_model/checkpoint`` holds a small Llama-architecture code-completion model in
Hugging Face layout, trained by :mod:`kvserve.default_model.train_default` on the Python
standard library's sources. ``LLM()`` with no model argument serves it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["default_model_dir", "default_draft_model_dir"]


def default_model_dir() -> str:
    """Absolute path of the embedded default model directory (HF layout)."""
    return str((Path(__file__).resolve().parent / "checkpoint"))


def default_draft_model_dir() -> str:
    """Absolute path of the embedded draft model: a smaller sibling of the default model
    with its tokenizer, for ``speculative_config={"method": "draft_model", ...}``."""
    return str((Path(__file__).resolve().parent / "draft_checkpoint"))

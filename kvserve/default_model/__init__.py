"""The embedded default model shipped with kvserve.

``kvserve/default_model/checkpoint`` holds a small Llama-architecture code-completion model in
Hugging Face layout, trained on the Python standard library's sources by
``python -m tools.default_model.train_default`` (the training code lives outside the
package: kvserve only loads the result). ``LLM()`` with no model argument serves it.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

__all__ = ["default_model_dir", "default_draft_model_dir", "training_corpus_dir"]


def default_model_dir() -> str:
    """Absolute path of the embedded default model directory (HF layout)."""
    return str((Path(__file__).resolve().parent / "checkpoint"))


def default_draft_model_dir() -> str:
    """Absolute path of the embedded draft model: a smaller sibling of the default model
    with its tokenizer, for ``speculative_config={"method": "draft_model", ...}``."""
    return str((Path(__file__).resolve().parent / "draft_checkpoint"))


def training_corpus_dir() -> Path:
    """Root of the corpus the embedded models are trained on: this interpreter's standard
    library. ``training_info.json`` lists the held-out files relative to it."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()

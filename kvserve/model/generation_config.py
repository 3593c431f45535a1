"""The sampling defaults a checkpoint's ``generation_config.json`` recommends, applied
where a request leaves a field unset, as vLLM's ``--generation-config`` does.

``auto`` reads the model directory's file, a directory reads that one's, ``vllm`` reads
none (the engine's own defaults). As in vLLM, a field counts only where the file gives a
value other than transformers' default for it (a file saying ``top_k: 50`` recommends
nothing), and ``max_new_tokens`` becomes ``max_tokens``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json's name -> SamplingParams' name, and transformers' default
FIELDS = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0),
          "top_k": ("top_k", 50), "min_p": ("min_p", None),
          "repetition_penalty": ("repetition_penalty", 1.0),
          "max_new_tokens": ("max_tokens", None)}


def sampling_defaults(source: str, model_dir: Path) -> dict[str, Any]:
    """The SamplingParams fields ``source`` recommends ({} for ``vllm`` or no file)."""
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else Path(source)
    if source != "auto" and not folder.is_dir():
        raise ValueError(f"generation_config must be auto, vllm or a directory holding a "
                         f"generation_config.json; {source!r} is not a directory")
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"generation_config {source!r} has no generation_config.json")
        return {}
    try:
        given = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    return {ours: given[name] for name, (ours, default) in FIELDS.items()
            if given.get(name) is not None and given[name] != default}

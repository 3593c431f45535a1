"""The architectures kvserve loads, one registration line each: Hugging Face's class
name (config.json's ``architectures``) -> the model class that runs it.

A model class reads its own config keys (``arch_config``) and says what it supports
(``notes``: the README's model table is generated from them). A new architecture is a
model file composed from ``decoder.py``'s layers plus one line here.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvserve.model.config import ArchConfig
from kvserve.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from kvserve.model.gpt2 import GPT2LMHeadModel
from kvserve.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from kvserve.model.moe_models import MixtralForCausalLM, Qwen2MoeForCausalLM, \
    Qwen3MoeForCausalLM
from kvserve.model.olmo2 import Olmo2ForCausalLM
from kvserve.model.phi3 import Phi3ForCausalLM
from kvserve.model.qwen3 import Qwen3ForCausalLM
from kvserve.registry import Registry

MODELS: Registry[type] = Registry("architecture")
MODELS.register("LlamaForCausalLM", LlamaForCausalLM)
MODELS.register("MistralForCausalLM", MistralForCausalLM)
MODELS.register("Qwen2ForCausalLM", Qwen2ForCausalLM)
MODELS.register("Qwen3ForCausalLM", Qwen3ForCausalLM)
MODELS.register("Olmo2ForCausalLM", Olmo2ForCausalLM)
MODELS.register("Phi3ForCausalLM", Phi3ForCausalLM)
MODELS.register("MixtralForCausalLM", MixtralForCausalLM)
MODELS.register("Qwen2MoeForCausalLM", Qwen2MoeForCausalLM)
MODELS.register("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)
MODELS.register("Gemma2ForCausalLM", Gemma2ForCausalLM)
MODELS.register("Gemma3ForCausalLM", Gemma3ForCausalLM)
MODELS.register("GPT2LMHeadModel", GPT2LMHeadModel)


def arch_config(cfg: dict, source: str = "config.json") -> ArchConfig:
    """The engine's view of a Hugging Face config: the first of its ``architectures``
    that is registered, read by that model class."""
    archs = cfg.get("architectures") or []
    name = next((a for a in archs if a in MODELS), None)
    if name is None:
        raise ValueError(f"{source}: architecture {archs or cfg.get('model_type')!r} is not "
                         f"supported; supported: {', '.join(MODELS.names())}")
    return MODELS[name].arch_config(name, cfg)


def read_arch_config(model_dir: str | Path) -> ArchConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model directory {model_dir} has no config.json")
    return arch_config(json.loads(path.read_text()), source=str(path))


def model_table() -> str:
    """The README's table of supported architectures."""
    rows = [f"| `{name}` | {MODELS[name].notes} |" for name in MODELS.names()]
    return "\n".join(["| architecture | notes |", "|---|---|", *rows])

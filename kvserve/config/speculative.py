"""SpeculativeConfig: vLLM's ``speculative_config`` object, validated.

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
"prompt_lookup_max": b}``: prompt lookup. ``{"method": "draft_model", "model": DIR,
"num_speculative_tokens": k}``: a smaller model with the same tokenizer guesses greedily
(the draft model is checked against the target when the engine config is built:
:func:`kvserve.spec_decode.draft_model.check_draft_model`).
``num_speculative_tokens`` is the most drafts a request may carry in one step; the
engine chooses fewer (0 included) each step where they would not pay
(:mod:`kvserve.spec_decode.controller`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from kvserve.config.validate import positive_int

MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # a name in kvserve.spec_decode.PROPOSERS
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # the draft model's directory (method draft_model)

    def __post_init__(self) -> None:
        positive_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError("speculative_config.num_speculative_tokens must be at most "
                             f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        positive_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min)
        positive_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max)
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model is required for method 'draft_model': "
                             "the draft model's directory (e.g. kvserve.default_draft_model_dir())")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config.model is only for method 'draft_model', not "
                             f"{self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must not exceed prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_value(cls, value: dict | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text (the CLI's ``--speculative-config``); None: off."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; allowed: "
                             f"{allowed}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config needs '{name}'")
        return cls(**value)

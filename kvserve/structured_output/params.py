"""StructuredOutputsParams: what the output must match (vLLM's structured_outputs)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.structured_output.reasoning import ReasoningSpan


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, dict or text), ``regex``, ``choice`` (the
    output is one of these strings), ``grammar`` (Lark, or GBNF), ``json_object`` (any
    JSON object). ``reasoning``: the constraint binds what follows the model's thinking
    (None: the whole output)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    reasoning: ReasoningSpan | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar or json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of "
                             "non-empty strings")

    def spec(self) -> tuple[str, str]:
        """(llguidance's grammar format, the grammar text); also the compile cache key."""
        if self.json_object:
            return "json_schema", '{"type": "object"}'
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json,
                                                                          sort_keys=True)
            return "json_schema", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar

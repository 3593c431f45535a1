"""Tool-call formats: how a model writes a call, how it is parsed, and the grammar that
forces one (``tool_choice`` required or a named function). Registered by the name
``--tool-call-parser`` takes, as vLLM's.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block a
  call (Qwen2.5, Hermes and the embedded model's template);
- ``llama3_json``: a JSON object ``{"name": ..., "parameters": {...}}``, calls joined by
  ``; `` (Llama 3.1's JSON tool calling).
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod

from kvserve.registry import Registry

ParsedCall = tuple[str, str]  # (function name, arguments as JSON text)


def call_schema(functions: list[dict], arguments_key: str) -> dict:
    """A JSON schema that accepts a call of any of ``functions`` with valid arguments."""
    options = [{"type": "object",
                "properties": {"name": {"const": f["name"]},
                               arguments_key: f.get("parameters") or {"type": "object"}},
                "required": ["name", arguments_key], "additionalProperties": False}
               for f in functions]
    return {"anyOf": options, "x-guidance": {"whitespace_flexible": False}}


class ToolParser(ABC):
    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(the text outside the calls, or None; the calls found)."""

    @abstractmethod
    def grammar(self, functions: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance's) whose sentences are calls of ``functions``."""


class HermesParser(ToolParser):
    _BLOCK = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                calls.append((obj["name"], json.dumps(obj.get("arguments", {}))))
        rest = self._BLOCK.sub("", text).strip() if calls else text
        return (rest or None), calls

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        schema = json.dumps(call_schema(functions, "arguments"))
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return f'{start}\ncall: "<tool_call>" body "</tool_call>"\nbody: %json {schema}'


class Llama3JsonParser(ToolParser):
    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls = []
        for part in text.strip().split("; "):
            try:
                obj = json.loads(part)
            except json.JSONDecodeError:
                return text, []
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
                return text, []
            calls.append((obj["name"], json.dumps(obj.get("parameters", {}))))
        return None, calls

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        schema = json.dumps(call_schema(functions, "parameters"))
        start = 'start: body ("; " body)*' if parallel else "start: body"
        return f"{start}\nbody: %json {schema}"


TOOL_PARSERS: Registry[type[ToolParser]] = Registry("tool_call_parser")
TOOL_PARSERS.register("hermes", HermesParser)
TOOL_PARSERS.register("llama3_json", Llama3JsonParser)

"""Tool-call formats: how a model writes a call, how it is read (whole, or as far as it
is written while streaming), and the grammar that forces one (``tool_choice`` required
or a named function). Registered by the name ``--tool-call-parser`` takes, as vLLM's.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block a
  call (Qwen2.5/Qwen3, Hermes and the embedded model's template);
- ``llama3_json``: the answer is JSON objects ``{"name": ..., "parameters": {...}}``
  joined by ``;`` (Llama 3.1/3.2's JSON tool calling, ``<|python_tag|>`` optional);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any text
  (Mistral and Mixtral instruct models; ``[TOOL_CALLS]`` is kept in the decoded text);
- ``pythonic``: the answer is a Python list of calls ``[f(a=1), g(b="x")]``, arguments as
  Python literals (Llama 3.2/4 and ToolACE-style models).

A parser's :meth:`~ToolParser.scan` reads the answer so far: the text outside the calls
and each call as far as it is written. Both only grow as the answer does, which is what
lets :class:`ToolCallStream` send them as deltas.
"""
from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod

from kvserve.entrypoints.openai.partial_json import (CallSoFar, held_prefix,
                                                     read_call_object, skip_ws)
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
    # whether the decoded answer must keep special tokens for the calls to be seen
    needs_special_tokens = False

    @abstractmethod
    def scan(self, text: str, final: bool) -> tuple[str, list[CallSoFar]]:
        """(the text outside the calls, the calls as far as written). Unless ``final``,
        what could still turn out to open a call is left out of the text."""

    @abstractmethod
    def grammar(self, functions: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance's) whose sentences are calls of ``functions``."""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(the text outside the calls, or None; the whole calls found). An answer with
        no whole call is all text."""
        content, calls = self.scan(text, final=True)
        found = [(c.name, c.arguments or "{}") for c in calls if c.valid]
        if not found:
            return text, []
        return (content.rstrip() or None), found


def _calls_in_list(text: str, pos: int, separator: str) -> list[CallSoFar]:
    """Call objects from ``text[pos]`` on, separated by ``separator``."""
    calls = []
    while pos < len(text) and text[pos] == "{":
        call = read_call_object(text, pos)
        calls.append(call)
        if not call.complete:
            break
        pos = skip_ws(text, call.end)
        if pos >= len(text) or text[pos] != separator:
            break
        pos = skip_ws(text, pos + 1)
    return calls


def _leading(text: str, prefix: str, final: bool) -> int | None:
    """Where the answer's body starts after whitespace and an optional ``prefix`` token;
    None while it is all whitespace or maybe the prefix's first characters."""
    s = skip_ws(text, 0)
    if prefix and text.startswith(prefix, s):
        s = skip_ws(text, s + len(prefix))
    elif prefix and s < len(text) and prefix.startswith(text[s:]) and not final:
        return None
    return None if s >= len(text) and not final else s


class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> tuple[str, list[CallSoFar]]:
        content, calls, pos = [], [], 0
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail[:len(tail) - (0 if final else held_prefix(tail, self.OPEN))])
                return "".join(content), calls
            content.append(text[pos:start])
            body = skip_ws(text, start + len(self.OPEN))
            close = text.find(self.CLOSE, body)
            inside = text if close < 0 else text[:close]
            calls.append(read_call_object(inside, body) if body < len(inside)
                         and inside[body] == "{" else CallSoFar())
            if close < 0:
                return "".join(content), calls
            pos = close + len(self.CLOSE)

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        schema = json.dumps(call_schema(functions, "arguments"))
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return f'{start}\ncall: "<tool_call>" body "</tool_call>"\nbody: %json {schema}'


class Llama3JsonParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> tuple[str, list[CallSoFar]]:
        s = _leading(text, self.PYTHON_TAG, final)
        if s is None:
            return "", []
        if s >= len(text) or text[s] != "{":
            return text, []
        return "", _calls_in_list(text, s, ";")

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        schema = json.dumps(call_schema(functions, "parameters"))
        start = 'start: body ("; " body)*' if parallel else "start: body"
        return f"{start}\nbody: %json {schema}"


class MistralParser(ToolParser):
    MARK = "[TOOL_CALLS]"
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> tuple[str, list[CallSoFar]]:
        start = text.find(self.MARK)
        if start < 0:
            return text[:len(text) - (0 if final else held_prefix(text, self.MARK))], []
        pos = skip_ws(text, start + len(self.MARK))
        if pos < len(text) and text[pos] == "[":
            pos = skip_ws(text, pos + 1)
        return text[:start], _calls_in_list(text, pos, ",")

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        schema = json.dumps(call_schema(functions, "arguments"))
        calls = 'body (", " body)*' if parallel else "body"
        return f'start: "{self.MARK}" "[" {calls} "]"\nbody: %json {schema}'


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_PY_STRING = r"""/'([^'\\\n]|\\.)*'/ | /"([^"\\\n]|\\.)*"/"""


def _closing_paren(text: str, i: int) -> int | None:
    """The index after the parenthesis matching ``text[i]``, skipping Python strings."""
    depth, j, quote = 0, i, None
    while j < len(text):
        c = text[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _keywords_as_json(call_text: str) -> str | None:
    """``f(a=1, b='x')`` -> ``{"a": 1, "b": "x"}``; None unless keywords of literals."""
    try:
        node = ast.parse(call_text, mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None
                                                              for k in node.keywords):
            return None
        return json.dumps({k.arg: ast.literal_eval(k.value) for k in node.keywords})
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


class PythonicParser(ToolParser):
    START = "<|python_start|>"

    def scan(self, text: str, final: bool) -> tuple[str, list[CallSoFar]]:
        s = _leading(text, self.START, final)
        if s is None:
            return "", []
        if s >= len(text) or text[s] != "[":
            return text, []
        calls, pos = [], s + 1
        while True:
            pos = skip_ws(text, pos)
            m = _NAME.match(text, pos)
            if m is None or m.end() >= len(text) or text[m.end()] != "(":
                return "", calls  # the name is whole once its "(" is written
            call = CallSoFar(name=m.group())
            calls.append(call)
            end = _closing_paren(text, m.end())
            if end is None:
                return "", calls
            arguments = _keywords_as_json(text[pos:end])
            call.complete, call.end = True, end
            call.arguments, call.broken = arguments or "", arguments is None
            pos = skip_ws(text, end)
            if pos >= len(text) or text[pos] != ",":
                return "", calls
            pos += 1

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        """Calls of the named functions with their parameters' names; the values are
        Python literals (their types are not checked against the schema)."""
        more = ' ("," " " call)*' if parallel else ""
        rules = [f'start: "[" call{more} "]"',
                 "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
        for i, f in enumerate(functions):
            names = list(((f.get("parameters") or {}).get("properties") or {}))
            if not names:
                rules.append(f'call_{i}: "{f["name"]}()"')
                continue
            rules.append(f'call_{i}: "{f["name"]}(" (kw_{i} (", " kw_{i})*)? ")"')
            rules.append(f"kw_{i}: (" + " | ".join(json.dumps(n) for n in names)
                         + ') "=" value')
        rules += ['value: STRING | NUMBER | "True" | "False" | "None" | list | dict',
                  'list: "[" (value (", " value)*)? "]"',
                  'dict: "{" (STRING ": " value (", " STRING ": " value)*)? "}"',
                  f"STRING: {_PY_STRING}",
                  r"NUMBER: /-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?/"]
        return "\n".join(rules)


TOOL_PARSERS: Registry[type[ToolParser]] = Registry("tool_call_parser")
TOOL_PARSERS.register("hermes", HermesParser)
TOOL_PARSERS.register("llama3_json", Llama3JsonParser)
TOOL_PARSERS.register("mistral", MistralParser)
TOOL_PARSERS.register("pythonic", PythonicParser)

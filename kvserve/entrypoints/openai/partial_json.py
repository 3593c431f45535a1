"""Reading JSON that is still being written: where a value ends (or that it has not yet),
and a call object's ``name`` and raw arguments text so far. Tool-call parsers use it to
stream a call's arguments as the model writes them; the arguments' text only grows, so
what was sent stays a prefix of the whole."""
from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")


def held_prefix(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag`` (held back from a
    stream until the next characters say whether the tag follows)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """The index after the string literal opening at ``text[i]`` (a quote), or None."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at ``text[i]``, or None while it is
    unfinished. A bare scalar (number, true, ...) ends at the next delimiter."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


@dataclass
class CallSoFar:
    """One call as far as it is written: ``name`` once its string is whole, the
    arguments' raw JSON text so far, and whether the call object is closed."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False
    end: int | None = None  # the index after the closed object
    broken: bool = False  # closed, but its arguments could not be read

    @property
    def valid(self) -> bool:
        """A whole call whose arguments are a JSON object."""
        if not (self.complete and self.name) or self.broken:
            return False
        try:
            return isinstance(json.loads(self.arguments or "{}"), dict)
        except json.JSONDecodeError:
            return False


def read_call_object(text: str, i: int) -> CallSoFar:
    """The call object ``{"name": ..., "arguments": {...}}`` opening at ``text[i]``
    ("parameters" is read as "arguments", as Llama 3's format writes it)."""
    call = CallSoFar()
    pos = i + 1
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return call
        if text[pos] == "}":
            call.complete, call.end = True, pos + 1
            return call
        if text[pos] == ",":
            pos += 1
            continue
        if text[pos] != '"':
            return call  # not JSON: never completes
        key_end = string_end(text, pos)
        if key_end is None:
            return call
        try:
            key = json.loads(text[pos:key_end])
        except json.JSONDecodeError:
            return call
        pos = skip_ws(text, key_end)
        if pos >= len(text) or text[pos] != ":":
            return call
        pos = skip_ws(text, pos + 1)
        if pos >= len(text):
            return call
        end = value_end(text, pos)
        if key == "name" and end is not None:
            try:
                name = json.loads(text[pos:end])
            except json.JSONDecodeError:
                return call
            call.name = name if isinstance(name, str) else None
        elif key in ARGUMENT_KEYS:
            call.arguments = text[pos:end if end is not None else len(text)]
        if end is None:
            return call
        pos = end

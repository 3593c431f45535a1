"""Reasoning parsers: a reasoning model's answer split into its thinking
(``reasoning_content``) and its reply (``content``), whole or as a stream goes, as
vLLM's ``--reasoning-parser`` does.

- ``deepseek_r1``: the chat template opens the think block, so the answer is reasoning
  until ``</think>`` (a ``<think>`` the model writes itself is dropped).
- ``qwen3``: reasoning only when the answer opens with ``<think>`` (with
  ``enable_thinking`` false Qwen3's template writes an empty think block into the
  prompt, and the answer is all reply).
"""
from __future__ import annotations

from kvserve.entrypoints.openai.partial_json import held_prefix
from kvserve.registry import Registry
from kvserve.structured_output.reasoning import ReasoningSpan

START, END = "<think>", "</think>"


class ReasoningParser:
    opened_by_prompt = True  # the answer starts inside the think block

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for an empty part."""
        stream = self.stream()
        reasoning, content = stream.feed(text, final=True)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.opened_by_prompt)

    def span(self) -> ReasoningSpan:
        """The thinking's bounds, for an output constraint that binds what follows."""
        return ReasoningSpan(START, END, self.opened_by_prompt)


class DeepSeekR1Parser(ReasoningParser):
    opened_by_prompt = True


class Qwen3Parser(ReasoningParser):
    opened_by_prompt = False


class ReasoningStream:
    """Text fed as it comes; each feed returns the reasoning and content it settles.
    What could still be the start of a tag is held back until the next feed."""

    def __init__(self, opened_by_prompt: bool) -> None:
        # undecided: waiting to see whether the answer opens with <think> (qwen3)
        self.state = "reasoning" if opened_by_prompt else "undecided"
        self.buffer = ""
        self.at_start = True  # a <think> the model writes first is dropped

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        if self.state == "undecided":
            stripped = self.buffer.lstrip()
            if stripped.startswith(START):
                self.state, self.buffer = "reasoning", stripped[len(START):]
                self.at_start = False
            elif START.startswith(stripped) and not final:
                return "", ""  # maybe the tag's first characters
            else:
                self.state = "content"
        if self.state == "reasoning":
            if self.at_start:
                stripped = self.buffer.lstrip()
                if stripped.startswith(START):
                    self.buffer = stripped[len(START):]
                    self.at_start = False
                elif START.startswith(stripped) and stripped and not final:
                    return "", ""
                else:
                    self.at_start = not stripped and not final
            end = self.buffer.find(END)
            if end >= 0:
                reasoning, self.buffer = self.buffer[:end], self.buffer[end + len(END):]
                self.state = "content"
            else:
                keep = 0 if final else held_prefix(self.buffer, END)
                reasoning = self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
        if self.state == "content":
            content, self.buffer = self.buffer, ""
        return reasoning, content


REASONING_PARSERS: Registry[type[ReasoningParser]] = Registry("reasoning_parser")
REASONING_PARSERS.register("deepseek_r1", DeepSeekR1Parser)
REASONING_PARSERS.register("qwen3", Qwen3Parser)

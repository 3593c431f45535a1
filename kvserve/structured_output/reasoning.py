"""Output constraints for reasoning models bind the answer after the thinking, as vLLM's
structured outputs do beside a reasoning parser: the grammar's mask is off while the model
thinks and on from the first token after the block's end tag."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReasoningSpan:
    """How a reasoning model's thinking is delimited. ``opened_by_prompt``: the answer
    starts inside the block (DeepSeek-R1's template opens it); otherwise the answer
    thinks only if its first token opens ``start`` (Qwen3), and that first token may be
    either the tag or one the grammar allows."""

    start: str = "<think>"
    end: str = "</think>"
    opened_by_prompt: bool = True


UNDECIDED, THINKING, ANSWERING = "undecided", "thinking", "answering"


@dataclass
class ReasoningGate:
    """One constrained request's place: undecided (its first token still to come),
    thinking (no mask) or answering (the grammar binds tokens from ``body_from`` on)."""

    span: ReasoningSpan
    state: str = ""
    token_ids: list[int] = field(default_factory=list)  # the output so far
    body_from: int = 0

    def __post_init__(self) -> None:
        self.state = self.state or (THINKING if self.span.opened_by_prompt else UNDECIDED)

    def advance(self, new: list[int], decode) -> list[int]:
        """Take the request's new tokens; returns those the grammar must now consume
        (empty while thinking)."""
        before = len(self.token_ids)
        self.token_ids += new
        if self.state == UNDECIDED and self.token_ids:
            opens = decode(self.token_ids[:1]).lstrip().startswith(self.span.start)
            self.state = THINKING if opens else ANSWERING
            before = 0
        if self.state == THINKING:
            end = self.end_of_thinking(self.token_ids, decode)
            if end is None:
                return []
            self.state, self.body_from, before = ANSWERING, end, end
        return self.token_ids[max(before, self.body_from):]

    def end_of_thinking(self, token_ids: list[int], decode) -> int | None:
        """The index after the token that completes the end tag, or None."""
        if self.span.end not in decode(token_ids):
            return None
        return next(j for j in range(1, len(token_ids) + 1)
                    if self.span.end in decode(token_ids[:j]))

    def thinking_drafts(self, drafts: list[int], decode) -> list[int]:
        """Drafts up to (not including) the one that would end the thinking: the token
        after the end tag must be sampled under the grammar's mask."""
        if self.state == UNDECIDED:
            return []
        for i in range(len(drafts)):
            if self.span.end in decode(self.token_ids + drafts[:i + 1]):
                return drafts[:i]
        return drafts

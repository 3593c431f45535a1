"""A token's own text and bytes, as logprobs report them.

A token that is part of a UTF-8 character decodes to U+FFFD on its own; its bytes come
from its vocabulary piece instead: sentencepiece's byte fallback (``<0xAB>``) or GPT-2's
byte-level alphabet, where each byte is drawn as one printable character.
"""
from __future__ import annotations

import re


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character standing for each byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_LEVEL = _byte_level_decoder()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """Token id -> its text (and raw bytes) for logprobs, cached: the vocabulary is finite."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 1_000_000:
                self._cache[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes, also for a token that is part of a UTF-8 character."""
        text = self(token_id)
        if "\ufffd" in text:
            piece = self._tok.id_to_token(token_id) or ""
            m = _BYTE_PIECE.fullmatch(piece)
            if m:  # sentencepiece byte fallback
                return [int(m.group(1), 16)]
            if piece and all(c in _BYTE_LEVEL for c in piece):  # byte-level BPE
                return [_BYTE_LEVEL[c] for c in piece]
        return list(text.encode("utf-8"))

"""The llguidance backend: grammars compiled once per spec, one matcher per sequence.

llguidance reads the model's tokenizer.json itself and computes a token mask in tens of
microseconds for a vocabulary this size, releasing the GIL while it does.
"""
from __future__ import annotations

import functools

import numpy as np
import torch


class GuidanceBackend:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_ids)
        self.executor = llguidance.LLExecutor()

    @functools.lru_cache(maxsize=256)
    def compile(self, fmt: str, text: str) -> str:
        """The grammar for (format, text), checked; ValueError naming the problem. JSON
        is generated compact (no free whitespace between tokens): small models otherwise
        fill the allowed whitespace instead of finishing the object."""
        if fmt == "json_schema":
            text = _compact_json(text)
        try:
            grammar = self._llg.grammar_from(fmt, text)
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from None
        error = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"structured_outputs: the {fmt} cannot be used: "
                             f"{error.strip().splitlines()[0]}")
        return grammar

    def matcher(self, grammar: str):
        m = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs: {m.get_error()}")
        return m

    def mask(self, matcher) -> torch.Tensor:
        """The tokens ``matcher`` allows next, as a bool tensor over the vocabulary."""
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")
        return torch.from_numpy(bits[:self.vocab_size].astype(bool))

    def masks(self, matchers: list) -> torch.Tensor:
        """The next-token masks of many matchers [len, vocab], computed in parallel by
        llguidance's own threads in one call."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

        words = allocate_token_bitmask(len(matchers), self.vocab_size)
        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                    words)
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :self.vocab_size].astype(bool))


def _compact_json(schema_text: str) -> str:
    import json

    schema = json.loads(schema_text)
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return json.dumps(schema)

"""Prompt lookup: the longest recent n-gram that ends the context and occurred before
proposes the tokens that followed that earlier occurrence.

n runs from ``prompt_lookup_max`` down to ``prompt_lookup_min``; the most recent earlier
occurrence of the context's last n tokens wins. Each request's tokens are kept in a
growing array, so a step only appends what is new.
"""
from __future__ import annotations

import numpy as np

from kvserve.request import Request
from kvserve.spec_decode.proposer import Proposer


def lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the most recent earlier match of the longest
    suffix of ``tokens`` of length n_min..n_max.

    Every earlier occurrence of the last token is a candidate end of a match (one
    comparison over the context); the candidates are then extended backwards together,
    a token at a time, as long as any still matches. Most steps of most texts have few
    candidates, so this costs little more than the one comparison."""
    size = len(tokens)
    if size < 2 or n_min > size - 1:
        return []
    ends = np.flatnonzero(tokens[:size - 1] == tokens[size - 1])  # each leaves a follower
    if not len(ends):
        return []
    matched = np.ones(len(ends), dtype=np.int64)  # suffix tokens matched, ending there
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(n_max, size - 1)):
        starts = ends - back
        alive &= starts >= 0
        alive[alive] = tokens[starts[alive]] == tokens[size - 1 - back]
        if not alive.any():
            break
        matched += alive
    longest = int(matched.max())
    if longest < n_min:
        return []
    end = int(ends[np.flatnonzero(matched >= longest)[-1]])
    return tokens[end + 1:end + 1 + k].tolist()


class _History:
    __slots__ = ("tokens", "size")

    def __init__(self, capacity: int) -> None:
        self.tokens = np.empty(capacity, dtype=np.int64)
        self.size = 0

    def sync(self, req: Request) -> np.ndarray:
        total = req.num_tokens
        if total > len(self.tokens):
            grown = np.empty(max(total, 2 * len(self.tokens)), dtype=np.int64)
            grown[:self.size] = self.tokens[:self.size]
            self.tokens = grown
        if total < self.size:  # output trimmed (a stop string): start again
            self.size = 0
        if self.size < total:
            self.tokens[self.size:total] = req.token_slice(self.size, total)
            self.size = total
        return self.tokens[:total]


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_min: int = 2, prompt_lookup_max: int = 5) -> None:
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self._histories: dict[str, _History] = {}

    @classmethod
    def from_config(cls, config, worker) -> NgramProposer:
        spec = config.speculative
        return cls(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, requests: list[Request], limits: dict[str, int]) -> dict[str, list[int]]:
        drafts = {}
        for req in requests:
            k = limits.get(req.request_id, 0)
            if k <= 0:
                continue
            history = self._histories.get(req.request_id)
            if history is None:
                history = self._histories[req.request_id] = _History(req.max_total_tokens)
            found = lookup(history.sync(req), self.n_min, self.n_max, k)
            if found:
                drafts[req.request_id] = found
        return drafts

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._histories.pop(rid, None)

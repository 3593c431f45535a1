"""Prompt lookup: the longest recent n-gram that ends the context and occurred before
proposes the tokens that followed that earlier occurrence.

n runs from ``prompt_lookup_max`` down to ``prompt_lookup_min``; the most recent earlier
occurrence of the context's last n tokens wins. Each request's tokens are kept in a
growing array, so a step only appends what is new.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvserve.request import Request
from kvserve.spec_decode.proposer import Proposer


def lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the most recent earlier match of the longest
    suffix of ``tokens`` of length n_min..n_max."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[:size - 1], n)  # starts that leave a follower
        hits = np.flatnonzero((windows == tokens[size - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


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

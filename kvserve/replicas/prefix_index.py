"""An approximate prefix tree of the prompts each replica has seen.

A prompt (a string, or a sequence of token ids) is cut into blocks of ``BLOCK`` items;
each block's key is a hash of everything up to its end, so a block key names one path
from the root of a prefix tree, as the engine's own prefix cache names its KV blocks.
A replica's match for a prompt is how many leading blocks it has seen. Each replica
keeps at most ``capacity`` blocks and forgets the least recently used first, since its
engine's cache evicts too: the index is a guess at the caches, never a lookup of them.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

BLOCK = 16


def block_keys(prompt: Sequence) -> list[int]:
    """The chained hashes of ``prompt``'s full blocks (a partial last block is not kept)."""
    keys, parent = [], 0
    for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
        parent = hash((parent, tuple(prompt[start:start + BLOCK])))
        keys.append(parent)
    return keys


class PrefixIndex:
    """Per replica: the LRU set of block keys of prompts routed to it."""

    def __init__(self, num_replicas: int, capacity: int) -> None:
        self.capacity = capacity
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def match(self, keys: Sequence[int], replica: int) -> int:
        """How many leading blocks of ``keys`` ``replica`` has seen."""
        seen = self._seen[replica]
        n = 0
        for key in keys:
            if key not in seen:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[int], replica: int) -> None:
        seen = self._seen[replica]
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def size(self, replica: int) -> int:
        return len(self._seen[replica])

    def forget(self, replica: int) -> None:
        """A restarted replica starts with an empty cache."""
        self._seen[replica].clear()

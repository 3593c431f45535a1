"""Content hashes of full KV blocks, so requests with a common prefix share blocks.

A block's hash chains its parent's hash with its own tokens, so equal hashes mean
equal whole prefixes, not just equal blocks. Only full blocks are cached.
"""
from __future__ import annotations

from typing import Sequence


def chain_hashes(tokens: Sequence[int], block_size: int, num_blocks: int,
                 known: list[int], root: int | None = None) -> list[int]:
    """Extend ``known`` (hashes of the first blocks) to the first ``num_blocks`` blocks;
    ``root``: the first block's parent (a LoRA adapter's key: its KV is its own)."""
    hashes = list(known)
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_blocks):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    """hash -> block id for full blocks whose KV is valid, cached or in use.

    A block stays registered while free, until the pool hands it out again (eviction).
    """

    def __init__(self) -> None:
        self._block_of: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self.queries = 0  # prompt tokens looked up
        self.hits = 0     # of which found cached

    def __len__(self) -> int:
        return len(self._block_of)

    def lookup(self, block_hash: int) -> int | None:
        return self._block_of.get(block_hash)

    def register(self, block_hash: int, block: int) -> None:
        """Remember a newly filled block; the first block with a given content wins."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def evict(self, block: int) -> None:
        """The pool is reusing ``block`` for new content."""
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]

    def hash_of(self, block: int) -> int | None:
        return self._hash_of.get(block)

"""Prompt lookup proposes what followed the most recent earlier match of the longest
suffix it can find."""
from __future__ import annotations

import numpy as np

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.ngram import NgramProposer, lookup


def _a(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # suffix (7, 8, 9) occurred at the start; (8, 9) alone occurred later, followed by 5
    tokens = _a(7, 8, 9, 1, 2, 3, 8, 9, 5, 6, 7, 8, 9)
    assert lookup(tokens, 1, 3, 4) == [1, 2, 3, 8]
    assert lookup(tokens, 1, 2, 4) == [5, 6, 7, 8]  # longest allowed is 2: the latest (8, 9)


def test_most_recent_occurrence_and_k_cap():
    tokens = _a(1, 2, 3, 1, 2, 4, 1, 2)
    assert lookup(tokens, 2, 2, 3) == [4, 1, 2]
    assert lookup(tokens, 2, 2, 1) == [4]


def test_no_match_or_too_short_gives_nothing():
    assert lookup(_a(1, 2, 3, 4), 1, 3, 4) == []
    assert lookup(_a(5), 1, 3, 4) == []
    assert lookup(_a(1, 2, 1, 3), 2, 3, 4) == []  # (1, 3) never occurred before


def _lookup_by_every_window(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """The definition, done the slow way: for n from n_max down, every earlier window
    of n tokens that leaves a follower, compared with the last n."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n:].tolist()
        starts = [s for s in range(size - n) if tokens[s:s + n].tolist() == suffix]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + k].tolist()
    return []


def test_lookup_agrees_with_the_definition_on_random_texts():
    rng = np.random.default_rng(0)
    for trial in range(3000):
        vocab = int(rng.integers(2, 12))  # small vocabularies: many partial matches
        tokens = rng.integers(0, vocab, size=int(rng.integers(1, 60))).astype(np.int64)
        n_min = int(rng.integers(1, 4))
        n_max = n_min + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        assert lookup(tokens, n_min, n_max, k) == _lookup_by_every_window(
            tokens, n_min, n_max, k), (tokens.tolist(), n_min, n_max, k)


def test_proposer_follows_a_growing_request_and_respects_limits():
    req = Request("r", [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=20), None, max_tokens=20)
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    assert proposer.propose([req], {"r": 3}) == {"r": [3, 4, 1]}
    req.output_token_ids += [3, 9]  # the context now ends with (3, 9): never seen before
    assert proposer.propose([req], {"r": 3}) == {}
    req.output_token_ids += [1]
    assert proposer.propose([req], {"r": 2}) == {"r": [2, 3]}
    assert proposer.propose([req], {}) == {}
    proposer.forget(["r"])
    assert proposer.propose([req], {"r": 1}) == {"r": [2]}

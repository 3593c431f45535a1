"""Verification keeps the target distribution: greedy gives plain argmax decoding, and
sampled tokens after drafts are distributed as plain sampling's (chi-square), a seeded
request's the very tokens plain sampling draws."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.core.scheduler_output import SamplingInfo
from kvserve.sampling_params import SamplingParams
from kvserve.worker.rejection_sampler import RejectionSampler
from kvserve.worker.sampler import Sampler

VOCAB = 6


def _info(**params) -> SamplingInfo:
    return SamplingInfo(SamplingParams(**params), [1, 2], [], None)


def test_greedy_accepts_the_argmax_prefix_then_corrects():
    logits = torch.full((4, VOCAB), -5.0)
    for row, best in enumerate([3, 4, 0, 2]):
        logits[row, best] = 5.0
    verify = RejectionSampler(Sampler(0))
    info = _info(temperature=0.0)
    assert [r.token_id for r in verify(logits, ["a"], [info], [[3, 4, 1]])[0]] == [3, 4, 0]
    assert [r.token_id for r in verify(logits, ["a"], [info], [[3, 4, 0]])[0]] == [3, 4, 0, 2]
    assert [r.token_id for r in verify(logits, ["a"], [info], [[5, 4, 0]])[0]] == [3]


def test_logprobs_are_those_of_each_tokens_own_row():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    drafts = [int(logits[0].argmax()), int(logits[1].argmax())]
    out = RejectionSampler(Sampler(0))(logits, ["a"], [_info(temperature=0.0, logprobs=2)],
                                       [drafts])[0]
    assert len(out) == 3
    for row, result in enumerate(out):
        expected = logits[row].log_softmax(-1)[result.token_id]
        assert result.logprob == pytest.approx(float(expected), abs=1e-6)


def _chi_square_p(counts: list[int], probs: list[float]) -> float:
    """Upper tail of Pearson's statistic (Wilson-Hilferty approximation)."""
    n = sum(counts)
    cells = [(c, n * p) for c, p in zip(counts, probs) if p > 0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    dof = len(cells) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                    dict(temperature=1.3, top_p=0.8),
                                    dict(temperature=1.0, presence_penalty=1.5)],
                         ids=["plain", "top-k", "top-p", "penalty"])
def test_first_and_second_token_keep_the_target_distribution(params):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 1.5
    sampler = Sampler(seed=3)
    verify = RejectionSampler(sampler)
    info = _info(**params)
    # the target distributions, as the sampler itself computes them
    first = sampler._filtered_probs(logits[:1] / params["temperature"], [info])[0]
    draft = [2, 4]
    trials = 6000
    firsts, seconds = [0] * VOCAB, [0] * VOCAB
    for _ in range(trials):
        tokens = [r.token_id for r in verify(logits, ["r"], [info], [draft])[0]]
        firsts[tokens[0]] += 1
        if tokens[0] == draft[0]:
            seconds[tokens[1]] += 1
    assert _chi_square_p(firsts, first.tolist()) > 1e-3
    # given the first draft was accepted, the second token follows row 1's distribution
    # with that draft in the context (penalties see it)
    row1 = SamplingInfo(info.params, info.prompt_token_ids, [draft[0]], None)
    processed = logits[1:2].clone()
    if info.params.uses_penalties:
        processed = sampler._apply_penalties(processed, [row1])
    second = sampler._filtered_probs(processed / params["temperature"], [row1])[0]
    assert sum(seconds) > 500
    assert _chi_square_p(seconds, second.tolist()) > 1e-3


def test_a_seeded_request_repeats_itself_whatever_the_batch():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    runs = []
    for neighbours in (0, 1):
        verify = RejectionSampler(Sampler(seed=neighbours))
        other = [_info(temperature=1.0)] * neighbours
        rows = torch.cat([logits] + [torch.randn(2, VOCAB)] * neighbours)
        out = verify(rows, ["s"] + ["o"] * neighbours, [_info(temperature=1.0, seed=9)] + other,
                     [[1]] + [[0]] * neighbours)
        runs.append([r.token_id for r in out[0]])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("wrong_at", [0, 2, None], ids=["first", "third", "none"])
def test_a_seeded_request_draws_the_tokens_plain_sampling_draws(wrong_at):
    """One draw per emitted token, as plain decoding: the same seed gives the same tokens
    with drafts as without, whichever draft is rejected."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    info = _info(temperature=1.0, seed=11)
    plain = Sampler(seed=0)
    expected = [plain(logits[j:j + 1], ["s"], [info])[0].token_id for j in range(4)]
    drafts = list(expected[:3])
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % VOCAB
    emitted = RejectionSampler(Sampler(seed=0))(logits, ["s"], [info], [drafts])[0]
    stop = 4 if wrong_at is None else wrong_at + 1
    assert [r.token_id for r in emitted] == expected[:stop]

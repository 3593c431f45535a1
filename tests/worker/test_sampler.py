"""The sampler on synthetic logits: filters, penalties, masks, seeds."""
from __future__ import annotations

import torch

from kvserve.core.scheduler_output import SamplingInfo
from kvserve.sampling_params import SamplingParams
from kvserve.worker.sampler import Sampler


def _info(prompt=(), output=(), eos=None, **kw):
    return SamplingInfo(SamplingParams(**kw), list(prompt), list(output), eos)


def _draws(logits, info, n=400):
    sampler = Sampler(seed=0)
    return [sampler(logits[None], ["r"], [info])[0].token_id for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 1.0, 0.0]])
    res = Sampler(0)(logits, ["a", "b"], [_info(temperature=0), _info(temperature=0)])
    assert [r.token_id for r in res] == [1, 0]


def test_top_k_restricts_support():
    logits = torch.tensor([4.0, 3.9, 3.8, 0.0, -1.0])
    assert set(_draws(logits, _info(temperature=1.0, top_k=2))) <= {0, 1}


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = _draws(probs.log(), _info(temperature=1.0, top_p=0.7))
    assert set(draws) == {0, 1}  # 0.5 alone < 0.7, so token 1 is needed; 2 and 3 are not


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([0.6, 0.3, 0.08, 0.02])
    draws = _draws(probs.log(), _info(temperature=1.0, min_p=0.2))
    assert set(draws) == {0, 1}


def test_sampling_follows_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    draws = _draws(probs.log(), _info(temperature=1.0), n=3000)
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.04)


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0]])
    info = _info(eos=1, output=[5], temperature=0, min_tokens=3, stop_token_ids=[2])
    assert Sampler(0)(logits, ["r"], [info])[0].token_id == 3


def test_repetition_penalty_like_transformers():
    logits = torch.tensor([[2.0, -1.0, 1.9, 0.5]])
    info = _info(prompt=[0], output=[1], temperature=0, repetition_penalty=2.0)
    res = Sampler(0)(logits, ["r"], [info])[0]
    assert res.token_id == 2  # token 0: 2.0 / 2 = 1.0 < 1.9


def test_frequency_and_presence_penalties():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    info = _info(output=[0, 0], temperature=0, frequency_penalty=0.2, presence_penalty=0.2)
    assert Sampler(0)(logits, ["r"], [info])[0].token_id == 1  # 3 - 0.4 - 0.2 < 2.5


def test_seeded_rows_ignore_the_rest_of_the_batch():
    logits = torch.randn(3, 50)
    infos = [_info(temperature=1.0), _info(temperature=1.0, seed=42), _info(temperature=0.7)]
    a = [Sampler(0)(logits, ["x", "s", "y"], infos)[1].token_id for _ in range(1)]
    b = Sampler(99)(logits[1:2], ["s"], [infos[1]])[0].token_id
    assert a[0] == b


def test_logprobs_rank_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    res = Sampler(0)(logits, ["r"], [_info(temperature=0, logprobs=2)])[0]
    ref = logits.log_softmax(-1)[0]
    assert res.token_id == 1 and res.rank == 1
    assert [t for t, _ in res.top_logprobs] == [1, 2]
    assert abs(res.logprob - float(ref[1])) < 1e-6


def test_bad_words_ban_single_tokens_and_sequence_ends():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])
    greedy = dict(temperature=0, bad_words_token_ids=[[1], [0, 2]])
    sampler = Sampler(0)
    # token 1 is banned everywhere; 2 only right after 0
    assert sampler(logits, ["a"], [_info(output=[3], **greedy)])[0].token_id == 2
    assert sampler(logits, ["a"], [_info(output=[3, 0], **greedy)])[0].token_id == 3


def test_logit_bias_shifts_the_chosen_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = Sampler.process(logits, [_info(logit_bias={0: 5.0, 2: -1.0})])
    assert out.tolist() == [[6.0, 2.0, 2.0]] and logits.tolist() == [[1.0, 2.0, 3.0]]

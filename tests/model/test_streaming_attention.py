"""StreamingLLM (attention_window + attention_sinks): each token attends to the first
sinks and its window, the sinks as if just before the window, computed as a cache of
re-positioned keys would give it; past the trained length; the same in every batching;
refused where it cannot hold."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.model.attention import KVCache, paged_attention
from kvserve.model.config import RopeConfig
from kvserve.model.rotary import RotaryEmbedding
from kvserve.worker.input_batch import build_inputs
from tests.helpers import hf_greedy, prompts_of_lengths


def _reference(q, k, v, sinks, window, rotary, scale):
    """Per query p: the sinks and the last ``window`` keys, each rotated at its position
    in StreamingLLM's cache (sinks first, then the window), the query at its own."""
    out = torch.empty_like(q)
    for p in range(q.shape[0]):
        start = max(sinks, p - window + 1)
        keys = [t for t in range(min(sinks, p + 1))] + list(range(start, p + 1))
        cache_pos = torch.tensor([t if t < sinks else sinks + t - start for t in keys])
        qp, _ = rotary(torch.tensor([sinks + p - start if p >= sinks else p]), q[p:p + 1],
                       q[p:p + 1])
        kp, _ = rotary(cache_pos, k[keys], k[keys])
        kp = kp.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        vp = v[keys].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = torch.einsum("hd,khd->hk", qp[0], kp) * scale
        out[p] = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), vp)
    return out


@pytest.mark.parametrize("block_size", [4, 16])
def test_sinks_are_scored_as_if_just_before_the_window(block_size):
    torch.manual_seed(0)
    n, heads, kv_heads, dim, sinks, window = 40, 4, 2, 16, 3, 9
    rotary = RotaryEmbedding(RopeConfig(), dim, 64)
    q, k, v = (torch.randn(n, h, dim) for h in (heads, kv_heads, kv_heads))
    positions = torch.arange(n)
    q_rot, k_rot = rotary(positions, q, k)
    table = list(range(-(-n // block_size)))
    inputs = build_inputs([ScheduledRequest("r", [0] * n, 0, table, None)], block_size,
                          window, None, sinks=sinks)
    cache = KVCache(len(table), block_size, kv_heads, dim, torch.float32)
    far = (positions - (sinks + window - 1)).clamp(min=0)
    got = paged_attention(q_rot, k_rot, v, cache, inputs.meta, dim ** -0.5,
                          q_sinks=rotary.rotate_back(far, q_rot))
    want = _reference(q, k, v, sinks, window, rotary, dim ** -0.5)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_with_nothing_evicted_greedy_tokens_are_transformers(model_dirs):
    prompts = prompts_of_lengths([10, 30], seed=2)
    llm = LLM(model_dirs("llama"), attention_window=60, attention_sinks=4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got == hf_greedy(model_dirs("llama"), prompts, 20)


def _streamed(**settings):
    llm = LLM(attention_window=96, attention_sinks=4, max_model_len=4096, **settings)
    prompt = prompts_of_lengths([1500], seed=5)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=0),
        use_tqdm=False)[0]
    logprobs = torch.tensor([e[t].logprob for e, t in zip(out.prompt_logprobs[1:],
                                                          prompt[1:])])
    assert llm.engine.kv.stats().num_used_blocks == 0
    return out.outputs[0].token_ids, logprobs


@pytest.mark.slow  # (15-25 s: `make test` stays near 10 minutes)
def test_past_the_trained_length_every_batching_gives_the_same_stream():
    """The embedded model (1024 positions) reads 1500 + 40 tokens, as one prompt chunk,
    in chunks of 64, and with small blocks: the same logprobs and tokens."""
    whole = _streamed()
    for settings in ({"max_num_batched_tokens": 64}, {"block_size": 4}):
        tokens, logprobs = _streamed(**settings)
        assert tokens == whole[0]
        assert torch.allclose(logprobs, whole[1], atol=1e-4)


@pytest.mark.parametrize("settings, message", [
    ({"attention_sinks": 4}, "needs attention_window"),
    ({"attention_window": 1000, "attention_sinks": 100}, "exceeds the model's 1024"),
])
def test_what_cannot_hold_is_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(**settings)


def test_a_model_with_its_own_window_is_refused(model_dirs):
    with pytest.raises(ValueError, match="sliding windows of its own"):
        LLM(model_dirs("mistral"), attention_window=16)

"""Beam search (LLM.beam_search) finds transformers' generate(num_beams=k) hypotheses,
scores within float32 tolerance, with its length penalties and early stopping; the
same in a pool too small to hold the beams at once."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM
from kvserve.engine.beam_search import BeamSearchParams
from tests.helpers import prompts_of_lengths

PROMPTS = prompts_of_lengths([4, 17, 30], seed=21)


def hf_beams(model_dir: str, prompt: list[int], k: int, max_new: int, length_penalty: float,
             early_stopping, eos: int | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k,
                         max_new_tokens=max_new, do_sample=False,
                         length_penalty=length_penalty, early_stopping=early_stopping,
                         eos_token_id=eos, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True)
    seqs = []
    for row, score in zip(out.sequences, out.sequences_scores):
        tokens = row[len(prompt):].tolist()
        if eos is not None and eos in tokens:  # what follows an EOS is padding
            tokens = tokens[:tokens.index(eos) + 1]
        seqs.append((tokens, float(score)))
    return seqs


@pytest.mark.parametrize("k, length_penalty, early_stopping", [
    (3, 1.0, False), (4, 0.0, "never"), (2, 2.0, True)])
def test_beams_are_transformers(llama_dir, k, length_penalty, early_stopping):
    llm = LLM(llama_dir)
    eos = llm.engine.eos_token_id
    params = BeamSearchParams(k, 12, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    got = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, got):
        want = hf_beams(llama_dir, prompt, k, 12, length_penalty, early_stopping, eos)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        for s, (_, score) in zip(out.sequences, want):
            assert abs(s.score - score) < 1e-4
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_eos_ends_a_hypothesis(llama_dir):
    """With an EOS the model writes early, some hypotheses stop before the limit."""
    llm = LLM(llama_dir)
    first = llm.beam_search([{"prompt_token_ids": PROMPTS[1]}],
                            BeamSearchParams(4, 10))[0].sequences[0].tokens
    eos = first[2]  # a token the best beam writes third: an EOS for this search
    hf = hf_beams(llama_dir, PROMPTS[1], 4, 10, 1.0, False, eos)
    llm.engine.eos_token_id = eos
    got = llm.beam_search([{"prompt_token_ids": PROMPTS[1]}], BeamSearchParams(4, 10))[0]
    assert [s.tokens for s in got.sequences] == [t for t, _ in hf]
    assert any(s.finish_reason == "stop" for s in got.sequences)


def test_in_a_pool_that_holds_one_long_beam_the_beams_are_the_same(llama_dir):
    """Beam requests decode one token each, so they wait rather than get preempted:
    in a pool of one 40-token sequence, with max_num_seqs 2, the same hypotheses."""
    params = BeamSearchParams(4, 10)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(llama_dir).beam_search(prompts, params)
    tight = LLM(llama_dir, num_kv_blocks=10, block_size=4, max_num_seqs=2)
    got = tight.beam_search(prompts, params)
    assert [[s.tokens for s in o.sequences] for o in got] == \
        [[s.tokens for s in o.sequences] for o in plain]
    assert tight.engine.kv.stats().prefix_hits > 0  # the beams shared their prefixes
    assert tight.engine.kv.stats().num_used_blocks == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(11, 5)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(2, 5, early_stopping="sometimes")

"""Embeddings from a decoder (PoolingParams, LLM.embed): its prompt's final hidden states
pooled as transformers' would be, in one chunk or many, beside generation requests in
the same steps and through preemption; the model's own pooling config read."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvserve import LLM, PoolingParams, SamplingParams
from tests.helpers import hf_greedy, prompts_of_lengths

PROMPTS = prompts_of_lengths([5, 23, 61], seed=11)


def hf_embeddings(model_dir: str, prompts, pooling: str, normalize: bool = True):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            hidden = model(input_ids=torch.tensor([p])).last_hidden_state[0]
            vec = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
            out.append(torch.nn.functional.normalize(vec, dim=0) if normalize else vec)
    return out


def _embed(llm, prompts, params=None):
    return [torch.tensor(o.outputs.embedding) for o in llm.embed(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 8, "block_size": 4}],
                         ids=["whole", "chunked"])
def test_pooled_hidden_states_are_transformers(llama_dir, pooling, settings):
    llm = LLM(llama_dir, **settings)
    got = _embed(llm, PROMPTS, PoolingParams(pooling=pooling))
    for g, w in zip(got, hf_embeddings(llama_dir, PROMPTS, pooling)):
        assert torch.allclose(g, w, atol=1e-5), (g - w).abs().max()
        assert abs(float(g.norm()) - 1) < 1e-5
    raw = _embed(llm, PROMPTS[:1], PoolingParams(pooling=pooling, normalize=False))[0]
    assert torch.allclose(raw, hf_embeddings(llama_dir, PROMPTS[:1], pooling, False)[0],
                          atol=1e-4)
    assert llm.engine.kv.stats().num_used_blocks == 0


def test_embeddings_and_generation_share_steps_and_survive_preemption(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=12, block_size=8, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"g{i}", {"prompt_token_ids": p}, params)
        engine.add_request(f"e{i}", {"prompt_token_ids": p}, PoolingParams())
    kinds, schedule = [], engine.scheduler.schedule

    def recorded():
        out = schedule()
        kinds.append({s.request_id[0] for s in out.scheduled})
        return out
    engine.scheduler.schedule = recorded
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert {"g", "e"} in kinds, "no step ran embedding and generation requests together"
    assert engine.scheduler.num_preemptions > 0, "no preemption: the test lost its point"
    want = hf_embeddings(llama_dir, PROMPTS, "last")
    for i in range(len(PROMPTS)):
        assert outs[f"e{i}"].outputs[0].token_ids == []
        assert torch.allclose(torch.tensor(outs[f"e{i}"].pooled), want[i], atol=1e-5)
    assert [outs[f"g{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == \
        hf_greedy(llama_dir, PROMPTS, 12)
    assert engine.kv.stats().num_used_blocks == 0


def test_a_sentence_transformers_model_pools_as_its_config_says(llama_dir, tmp_path):
    model_dir = tmp_path / "st"
    shutil.copytree(llama_dir, model_dir)
    (model_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [32]}))
    llm = LLM(str(model_dir), runner="pooling")
    got = _embed(llm, PROMPTS)
    for g, w in zip(got, hf_embeddings(str(model_dir), PROMPTS, "mean")):
        assert torch.allclose(g, w, atol=1e-5)
    cut = _embed(llm, PROMPTS[:1], PoolingParams(dimensions=32))[0]
    full = hf_embeddings(str(model_dir), PROMPTS[:1], "mean", normalize=False)[0]
    assert torch.allclose(cut, torch.nn.functional.normalize(full[:32], dim=0), atol=1e-5)
    with pytest.raises(ValueError, match="runner 'pooling'"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], use_tqdm=False)


def test_what_an_embedding_request_cannot_ask_is_refused(llama_dir):
    with pytest.raises(ValueError, match="not trained to be cut"):
        LLM(llama_dir).embed("x", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="runner 'generate'"):
        LLM(llama_dir, runner="generate").embed("x", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams(pooling="max")

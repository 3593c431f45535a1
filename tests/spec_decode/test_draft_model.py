"""The draft-model proposer: its own KV kept right across steps (a model drafting for
itself has every greedy draft accepted), transformers' tokens in every engine mode, its
blocks all returned, and bad draft models refused at start naming the field."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvserve import LLM, EngineArgs, SamplingParams, default_draft_model_dir
from tests.helpers import hf_greedy, prompts_of_lengths

MAX_NEW = 24


def draft_config(model_dir: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": model_dir, "num_speculative_tokens": k}


@pytest.fixture(autouse=True)
def slow_target_steps(monkeypatch):
    """Target steps far dearer than a draft pass, at any row count, and trusted as they
    are (not measured as the steps run), so the controller always drafts (a tiny random
    target is as cheap as its draft: measured, drafting would not pay)."""
    from kvserve.spec_decode import controller
    from kvserve.worker.cpu_worker import CPUWorker
    monkeypatch.setattr(CPUWorker, "time_step_rows",
                        lambda self, rows: {r: 1.0 * (1 + r / 1000) for r in rows})
    monkeypatch.setattr(controller, "LEARN_FROM_STEPS", False)


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_lengths([5, 9, 14, 3, 20, 7, 40, 2], seed=5)


@pytest.fixture(scope="module")
def oracle(llama_dir, prompts):
    return hf_greedy(llama_dir, prompts, MAX_NEW)


def _greedy(llm, prompts, max_new=MAX_NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _draft_pool(llm):
    """The draft model's block pool, in the worker that runs it."""
    return llm.engine.worker.inner.draft.pool


def _assert_all_returned(llm):
    pool = _draft_pool(llm)
    assert pool.num_free == pool.num_blocks, "draft KV blocks leaked"
    assert not llm.engine.speculator.proposer._held, "draft KV still counted as held"
    assert llm.engine.kv.stats().num_used_blocks == 0, "target KV blocks leaked"


@pytest.mark.parametrize("settings", [
    {},
    {"block_size": 4, "max_num_batched_tokens": 16},                 # chunked prompts
    {"num_kv_blocks": 24, "block_size": 8},                           # preemption, a small
    {"attention_backend": "torch"},                                   # draft pool
    {"max_num_seqs": 1},
    {"kv_manager": "buddy"},
    {"num_kv_blocks": 24, "block_size": 8, "preemption_mode": "swap"},
    {"kv_manager": "contiguous"},
], ids=["paged", "chunked", "preempt", "torch", "single", "buddy", "swap", "contiguous"])
def test_a_model_drafting_for_itself_has_every_draft_accepted(settings, llama_dir, prompts,
                                                               oracle):
    """The draft's guesses are the target's own greedy tokens only where the draft's KV
    holds exactly the request's tokens at the right positions after every step."""
    llm = LLM(llama_dir, speculative_config=draft_config(llama_dir), **settings)
    assert _greedy(llm, prompts) == oracle
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 50, stats
    assert stats.num_accepted_tokens >= 0.97 * stats.num_draft_tokens, stats
    _assert_all_returned(llm)


def perturbed_copy(model_dir: str, out: Path, scale: float) -> str:
    """The model with noise added to its last layer's MLP: a draft that agrees with it
    on some tokens only."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.startswith("model.layers.1.mlp."):
            weights[name] = w + scale * torch.randn(w.shape, generator=gen)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def test_another_draft_model_keeps_transformers_tokens(llama_dir, prompts, oracle, tmp_path):
    """A draft that agrees with the target only sometimes: drafts accepted and rejected,
    the target's tokens unchanged."""
    draft = perturbed_copy(llama_dir, tmp_path / "draft", 0.1)
    llm = LLM(llama_dir, speculative_config=draft_config(draft, 3))
    assert _greedy(llm, prompts) == oracle
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    _assert_all_returned(llm)


@pytest.mark.parametrize("settings", [{"quantization": "int8"}, {"kv_cache_dtype": "float16"}],
                         ids=["int8", "fp16-kv"])
def test_a_draft_changes_nothing_in_approximate_modes(settings, llama_dir, prompts):
    """The target runs int8 or a half KV cache, its draft plain float32: the drafts are
    only guesses, and the tokens are those of the same mode without speculation."""
    plain = _greedy(LLM(llama_dir, **settings), prompts)
    llm = LLM(llama_dir, speculative_config=draft_config(llama_dir), **settings)
    assert _greedy(llm, prompts) == plain
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    _assert_all_returned(llm)


def test_aborted_and_stopped_requests_give_the_draft_blocks_back(llama_dir, prompts):
    llm = LLM(llama_dir, speculative_config=draft_config(llama_dir))
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    for _ in range(4):
        engine.step()
    assert _draft_pool(llm).num_free < _draft_pool(llm).num_blocks
    engine.abort_request([str(i) for i in range(0, len(prompts), 2)])
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_returned(llm)


def test_the_shipped_draft_model_drafts_for_the_embedded_model():
    code = ("import os\n\n\ndef list_python_files(root):\n    found = []\n"
            "    for dirpath, dirnames, filenames in os.walk(root):\n")
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM().generate(code, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(speculative_config=draft_config(default_draft_model_dir()))
    assert llm.generate(code, params, use_tqdm=False)[0].outputs[0].token_ids == plain
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens >= 0.3 * stats.num_draft_tokens > 0, stats
    _assert_all_returned(llm)


def _copy_model(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_bad_draft_models_are_refused_naming_the_field(llama_dir, tmp_path):
    def refused(model, message):
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=llama_dir,
                       speculative_config=draft_config(str(model))).create_engine_config()

    refused(tmp_path / "missing", r"speculative_config.model .* is not a directory")
    other_vocab = _copy_model(llama_dir, tmp_path / "vocab")
    _edit_json(other_vocab / "config.json", lambda c: c.update(vocab_size=c["vocab_size"] + 8))
    refused(other_vocab, "vocabulary of .* tokens, the target")
    other_tokens = _copy_model(llama_dir, tmp_path / "tokens")

    def swap_two(tok):
        vocab = tok["model"]["vocab"]
        a, b = list(vocab)[40:42]
        vocab[a], vocab[b] = vocab[b], vocab[a]
    _edit_json(other_tokens / "tokenizer.json", swap_two)
    refused(other_tokens, "another tokenizer")
    broken = _copy_model(llama_dir, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    refused(broken, "does not load")
    with pytest.raises(ValueError, match="model is required for method 'draft_model'"):
        EngineArgs(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="only for method 'draft_model'"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                       "model": llama_dir})

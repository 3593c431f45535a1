"""Bad input gets a ValueError that names what is wrong and what is allowed."""
from __future__ import annotations

import pytest

from kvserve import LLM, EngineArgs, SamplingParams
from kvserve.config import parse_size


@pytest.mark.parametrize("kwargs, fragment", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"n": 0}, "n must"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logprobs": 100}, "logprobs"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 50}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"temperature": "hot"}, "temperature"),
])
def test_sampling_params_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": -1}, "max_num_seqs"),
    ({"dtype": "int4"}, "dtype"),
    ({"kv_manager": "magic"}, "kv_manager"),
    ({"batching": "greedy"}, "batching"),
    ({"kv_cache_memory": "lots"}, "memory size"),
])
def test_engine_args_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        EngineArgs(**kwargs)


def test_parse_size():
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size(1024) == 1024
    assert parse_size("1.5k") == 1500


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=128, num_kv_blocks=64, block_size=4)


def test_prompt_too_long_states_both_lengths(llm):
    with pytest.raises(ValueError, match=r"200 tokens.*max_model_len is 128"):
        llm.generate({"prompt_token_ids": [5] * 200}, use_tqdm=False)


def test_prompt_plus_max_tokens_over_context(llm):
    with pytest.raises(ValueError, match=r"100 tokens and max_tokens is 50.*128"):
        llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=50),
                     use_tqdm=False)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)


def test_token_id_out_of_vocab(llm):
    with pytest.raises(ValueError, match=r"integers in \[0, 512\)"):
        llm.generate({"prompt_token_ids": [1, 99999]}, use_tqdm=False)


def test_request_that_can_never_fit(llama_dir):
    small = LLM(llama_dir, num_kv_blocks=4, block_size=4)  # 16 token slots in all
    with pytest.raises(ValueError, match="KV cache holds at most 16 tokens"):
        small.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=10),
                       use_tqdm=False)
    assert small.engine.kv.stats().num_used_blocks == 0
    assert not small.engine.has_unfinished_requests()


def test_failed_batch_leaves_nothing_queued(llm):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError):
        llm.generate([good, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_unknown_engine_argument(llama_dir):
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(llama_dir, max_num_sequences=4)


def test_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_engine_survives_errors(llm):
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1

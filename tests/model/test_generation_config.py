"""generation_config.json's sampling defaults: read as vLLM reads them, applied where a
request leaves a field unset, dropped by ``--generation-config vllm``, named in
/v1/models; a request's own fields win."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.generation_config import sampling_defaults
from tests.entrypoints.conftest import ServerProcess
from tests.helpers import prompts_of_lengths

RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
               "max_new_tokens": 7, "do_sample": True, "eos_token_id": 1}


@pytest.fixture(scope="module")
def model_with_defaults(llama_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("with-defaults") / "m"
    shutil.copytree(llama_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return str(model_dir)


def test_the_fields_that_differ_from_transformers_defaults_are_read(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 1.0, "top_k": 50, "top_p": 0.8, "min_p": 0.05, "max_new_tokens": 9}))
    assert sampling_defaults("auto", tmp_path) == {"top_p": 0.8, "min_p": 0.05, "max_tokens": 9}
    assert sampling_defaults("vllm", tmp_path) == {}
    assert sampling_defaults("auto", tmp_path / "nowhere") == {}
    with pytest.raises(ValueError, match="must be auto, vllm or a directory"):
        sampling_defaults(str(tmp_path / "nowhere"), tmp_path)


def test_llm_uses_them_when_given_no_sampling_params(model_with_defaults, llama_dir):
    llm = LLM(model_with_defaults)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty,
            params.max_tokens) == (0.6, 0.95, 20, 1.05, 7)
    prompt = {"prompt_token_ids": prompts_of_lengths([5])[0]}
    out = llm.generate([prompt], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 7 and out.finish_reason in ("length", "stop")
    # given params are the caller's, whole
    own = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert len(llm.generate([prompt], own, use_tqdm=False)[0].outputs[0].token_ids) == 12
    assert LLM(model_with_defaults, generation_config="vllm").get_default_sampling_params() \
        == SamplingParams()
    assert LLM(llama_dir, generation_config=model_with_defaults) \
        .get_default_sampling_params().top_k == 20


def test_the_server_applies_them_to_unset_fields_and_lists_them(model_with_defaults,
                                                                 tmp_path):
    server = ServerProcess(model_with_defaults, tmp_path / "server.log")
    plain = ServerProcess(model_with_defaults, tmp_path / "plain.log",
                          "--generation-config", "vllm")
    try:
        server.wait_healthy()
        plain.wait_healthy()
        card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        assert card["default_sampling_params"] == {
            "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
            "max_tokens": 7}
        assert httpx.get(f"{plain.url}/v1/models").json()["data"][0][
            "default_sampling_params"] == {}
        body = {"prompt": "def f(", "ignore_eos": True, "seed": 3}
        done = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert done["usage"]["completion_tokens"] == 7  # the model's max_new_tokens
        chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        done = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
        assert done["usage"]["completion_tokens"] == 7
        done = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 3},
                          timeout=60).json()
        assert done["usage"]["completion_tokens"] == 3  # the request's own wins
        done = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60).json()
        assert done["usage"]["completion_tokens"] == 16  # OpenAI's default for completions
        assert "default sampling parameters from the model's generation_config.json" \
            in server.log()
    finally:
        server.terminate()
        plain.terminate()


def test_a_request_field_left_unset_takes_the_default_and_a_given_one_wins(llama_dir):
    from kvserve.entrypoints.openai.protocol import CompletionRequest
    from kvserve.entrypoints.openai.sampling import default_max_tokens, make_sampling_params
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 7}
    unset = CompletionRequest(model="m", prompt="x")
    params = make_sampling_params(unset, 5, None, None, defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 20, 1.0)
    given = CompletionRequest(model="m", prompt="x", temperature=0.0, top_k=-1)
    params = make_sampling_params(given, 5, None, None, defaults)
    assert (params.temperature, params.top_k) == (0.0, SamplingParams(top_k=-1).top_k)
    assert default_max_tokens(None, defaults, room=100) == 7
    assert default_max_tokens(None, defaults, room=4) == 4  # within the room left
    assert default_max_tokens(30, defaults, room=100) == 30
    assert default_max_tokens(None, {}, room=100) is None

"""LoRA adapters over HTTP with the official client: --lora-modules at start, the
request's model naming the adapter (tokens as peft's), /v1/models listing adapters with
their parent, the load and unload routes behind the API key, vLLM's lora_requests_info."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.conftest import ServerProcess, served
from tests.helpers import prompts_of_lengths
from tests.lora.adapters import LENGTHS, MAX_TOKENS

KEY = "sesame"


@pytest.fixture(scope="module")
def lora_server(llama_dir, lora_adapters, tmp_path_factory):
    adapters = lora_adapters("llama")
    yield from served(llama_dir, tmp_path_factory.mktemp("lora") / "server.log",
                      "--served-model-name", "base", "--api-key", KEY, "--enable-lora",
                      "--max-loras", "2", "--max-lora-rank", "16",
                      "--lora-modules", f"a0={adapters[0]}",
                      f'{{"name": "a1", "path": "{adapters[1]}"}}')


@pytest.fixture(scope="module")
def lora_client(lora_server):
    with openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key=KEY, max_retries=0,
                       timeout=60) as c:
        yield c


def _post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)


def test_the_model_field_picks_the_adapter(lora_client, llama_dir, lora_adapters,
                                          peft_tokens):
    """The server's text is the offline engine's for the same adapter, whose tokens are
    peft's."""
    from kvserve import LLM, LoRARequest, SamplingParams
    prompts = prompts_of_lengths(LENGTHS)[:3]
    llm = LLM(llama_dir, enable_lora=True, max_lora_rank=16, num_kv_blocks=100)
    loras = [None] + [LoRARequest(f"a{i}", i + 1, a)
                      for i, a in enumerate(lora_adapters("llama")[:2])]
    for model, which in (("base", 0), ("a0", 1), ("a1", 2)):
        offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                               lora_request=loras[which], use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in offline] == peft_tokens("llama")[which][:3]
        out = lora_client.completions.create(model=model, prompt=prompts,
                                             max_tokens=MAX_TOKENS, temperature=0)
        assert out.model == model
        assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == \
            [o.outputs[0].text for o in offline]
        if model == "a1":
            chunks = list(lora_client.completions.create(
                model=model, prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0,
                stream=True))
            assert {c.model for c in chunks} == {"a1"}
            assert "".join(c.choices[0].text for c in chunks if c.choices) == \
                offline[0].outputs[0].text


def test_models_list_adapters_with_their_parent(lora_client, lora_adapters):
    cards = {m.id: m for m in lora_client.models.list().data}
    assert set(cards) == {"base", "a0", "a1"}
    assert cards["a0"].parent == "base" and cards["a0"].root == lora_adapters("llama")[0]
    assert getattr(cards["base"], "parent", None) is None
    assert lora_client.models.retrieve("a1").parent == "base"


def test_adapters_load_and_unload_at_run_time(lora_server, lora_client, lora_adapters):
    path = lora_adapters("llama")[2]
    assert _post(lora_server, "/v1/load_lora_adapter",
                 {"lora_name": "late", "lora_path": path}, key=None).status_code == 401
    r = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert lora_client.completions.create(model="late", prompt="def", max_tokens=2).model == "late"
    again = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    r = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
    with pytest.raises(openai.NotFoundError, match="`late` does not exist"):
        lora_client.completions.create(model="late", prompt="def", max_tokens=2)
    gone = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize("body, param, message", [
    ({"lora_name": "x", "lora_path": "/nowhere"}, "lora_path", "is not a directory"),
    ({"lora_name": "base", "lora_path": "/nowhere"}, "lora_name", "already been loaded"),
    ({"lora_name": "x"}, "lora_path", "missing required parameter"),
    ({"lora_name": "x", "lora_path": "/nowhere", "load_inplace": True}, "load_inplace", ""),
])
def test_bad_loads_are_400s_naming_the_field(lora_server, body, param, message):
    r = _post(lora_server, "/v1/load_lora_adapter", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and param in (error["param"] or error["message"])


def test_the_lora_metric_names_running_adapters(lora_server, lora_client):
    lora_client.completions.create(model="a0", prompt="def", max_tokens=2)
    series = [k for k in lora_server.metrics() if k.startswith("kvserve:lora_requests_info")]
    assert series and all('max_lora="2"' in k for k in series)
    assert any('running_lora_adapters="a0"' in k for k in series)


def test_lora_modules_need_enable_lora(llama_dir, tmp_path):
    server = ServerProcess(llama_dir, tmp_path / "log", "--lora-modules", "a=/x")
    assert server.proc.wait(60) != 0
    server.terminate()
    assert "--lora-modules serves LoRA adapters: it needs --enable-lora" in server.log()

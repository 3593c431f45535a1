"""POST /v1/embeddings with the official client: strings, token ids, float and base64
vectors equal to LLM.embed's, usage counted, and what it cannot do refused by name."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.engine.test_embeddings import hf_embeddings
from tests.entrypoints.conftest import MODEL


def test_the_official_client_gets_transformers_embeddings(client, llama_dir):
    from kvserve.model.tokenizer import Tokenizer

    texts = ["def add(a, b):", "import os\nimport sys"]
    ids = [Tokenizer(llama_dir).encode(t) for t in texts]
    want = hf_embeddings(llama_dir, ids, "last")
    # unasked, the client asks for base64 and decodes it; asked, it hands it over as is
    for fmt in (None, "float", "base64"):
        out = client.embeddings.create(model=MODEL, input=texts,
                                       **({"encoding_format": fmt} if fmt else {}))
        assert [d.index for d in out.data] == [0, 1]
        for d, w in zip(out.data, want):
            vector = d.embedding if fmt != "base64" else \
                np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist()
            assert torch.allclose(torch.tensor(vector), w, atol=1e-5)
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model=MODEL, input=ids[0])
    assert torch.allclose(torch.tensor(by_ids.data[0].embedding), want[0], atol=1e-5)


@pytest.mark.parametrize("body, param, message", [
    ({"input": "x", "dimensions": 8}, "dimensions", "not trained to be cut"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "x", "truncate": True}, "truncate", ""),
])
def test_what_it_cannot_do_is_a_400_naming_the_field(server, body, param, message):
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and param in (error.get("param") or error["message"])


def test_a_generate_runner_refuses_embeddings(llama_dir, tmp_path):
    from tests.entrypoints.conftest import ServerProcess
    server = ServerProcess(llama_dir, tmp_path / "log", "--runner", "generate")
    try:
        server.wait_healthy()
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
            with pytest.raises(openai.BadRequestError, match="runner 'generate'"):
                c.embeddings.create(model=c.models.list().data[0].id, input="x")
    finally:
        server.terminate()

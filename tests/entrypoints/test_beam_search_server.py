"""use_beam_search in /v1/completions (vLLM's extra): n of best_of beams, transformers'
hypotheses, best first; what beam search cannot do beside it refused by name."""
from __future__ import annotations

import httpx
import pytest

from tests.engine.test_beam_search import PROMPTS, hf_beams
from tests.entrypoints.conftest import MODEL


def test_beam_search_answers_are_transformers(client, llama_dir):
    from kvserve.model.tokenizer import Tokenizer

    tok = Tokenizer(llama_dir)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8, n=2,
                                    extra_body={"use_beam_search": True, "best_of": 3})
    assert len(out.choices) == 4
    for i, prompt in enumerate(PROMPTS[:2]):
        want = hf_beams(llama_dir, prompt, 3, 8, 1.0, False, tok.eos_token_id)[:2]
        got = [c for c in out.choices if c.index // 2 == i]
        assert [c.text for c in got] == [tok.decode([t for t in tokens
                                                      if t != tok.eos_token_id])
                                         for tokens, _ in want]


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"),
    ({"temperature": 0.7}, "temperature"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"logprobs": 2}, "logprobs"),
])
def test_what_beam_search_cannot_do_is_refused(server, extra, param):
    r = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "prompt": "def f(", "max_tokens": 4, "use_beam_search": True, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("field, value", [("length_penalty", 2.0), ("early_stopping", True)])
def test_beam_search_fields_without_beam_search_are_refused(server, field, value):
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"prompt": "def f(", "max_tokens": 4, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text

"""`kvserve serve --speculative-config` (prompt lookup, the shipped draft model): the
OpenAI routes give plain decoding's text, streamed or not, and /metrics and the stats log
carry vLLM's spec_decode series."""
from __future__ import annotations

import json
import time

import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.default_model import default_draft_model_dir, default_model_dir
from tests.entrypoints.conftest import ServerProcess

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 4,
         "model": default_draft_model_dir()}
# a prompt the embedded model continues by repeating its lines: drafts from the prompt land
PROMPT = "x = 1\ny = 2\n" * 4 + "x = "


@pytest.fixture(scope="module", params=[SPEC, DRAFT], ids=["ngram", "draft_model"])
def spec_server(request, tmp_path_factory):
    log = tmp_path_factory.mktemp("spec_server") / "server.log"
    server = ServerProcess(default_model_dir(), log, "--speculative-config",
                           json.dumps(request.param),
                           "--log-stats-interval", "1")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.terminate()


def test_completions_match_plain_decoding_and_metrics_count_drafts(spec_server):
    # the model's repetition penalty would steer the answer away from the prompt's text
    plain = {"repetition_penalty": 1.0}
    expected = LLM().generate(PROMPT, SamplingParams(temperature=0, max_tokens=48, **plain),
                              use_tqdm=False)[0].outputs[0].text
    with openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="x", max_retries=0) as c:
        whole = c.completions.create(model="kvserve-default", prompt=PROMPT, max_tokens=48,
                                     temperature=0, extra_body=plain)
        streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
            model="kvserve-default", prompt=PROMPT, max_tokens=48, temperature=0, stream=True,
            extra_body=plain))
    assert whole.choices[0].text == streamed == expected
    assert whole.usage.completion_tokens == 48
    m = spec_server.metrics()
    drafted = m["kvserve:spec_decode_num_draft_tokens_total"]
    accepted = m["kvserve:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted and m["kvserve:spec_decode_num_drafts_total"] > 0
    per_pos = [m.get(f'kvserve:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}',
                     0) for i in range(4)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[-1]
    deadline = time.monotonic() + 10
    while "SpecDecoding metrics: Mean acceptance length" not in spec_server.log():
        assert time.monotonic() < deadline, spec_server.log()[-2000:]
        time.sleep(0.2)


def test_auto_tool_choice_on_a_template_that_shows_tools(spec_server):
    """The embedded model's template lists the tools; under `auto` the answer is text or a
    parsed call, never an error."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    with openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="x", max_retries=0) as c:
        out = c.chat.completions.create(model="kvserve-default", tools=tools, max_tokens=30,
                                        temperature=0, messages=[
                                            {"role": "user", "content": "find the docs"}])
    choice = out.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls[0].function.name == "lookup"
    else:
        assert choice.message.content is not None and not choice.message.tool_calls

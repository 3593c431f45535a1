"""Tool-call formats: parsing answers, and grammars that accept exactly valid calls."""
from __future__ import annotations

import json

import llguidance

from kvserve.default_model import default_model_dir
from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "days": {"type": "integer", "minimum": 1}},
    "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}


def test_hermes_parses_calls_and_keeps_the_rest_as_content():
    parser = TOOL_PARSERS["hermes"]()
    text = ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parser.parse(text)
    assert content == "Let me check."
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo"}),
                                                      ("get_time", {})]
    assert parser.parse("no call here") == ("no call here", [])
    assert parser.parse("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>",
                                                              [])


def test_llama3_json_parses_a_json_answer_only():
    parser = TOOL_PARSERS["llama3_json"]()
    content, calls = parser.parse('{"name": "get_time", "parameters": {}}; '
                                  '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert content is None and [n for n, _ in calls] == ["get_time", "get_weather"]
    assert parser.parse("Sure, here you go") == ("Sure, here you go", [])


def _accepts(grammar: str, text: str) -> bool:
    tok = llguidance.LLTokenizer(default_model_dir() + "/tokenizer.json", n_vocab=8192,
                                 eos_token=[1])
    matcher = llguidance.LLMatcher(tok, llguidance.grammar_from("lark", grammar))
    ids = tok.tokenize_str(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_forcing_grammars_accept_valid_calls_only():
    hermes = TOOL_PARSERS["hermes"]().grammar([WEATHER, TIME], parallel=False)
    assert _accepts(hermes, '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo",'
                            '"days":2}}</tool_call>')
    assert not _accepts(hermes, '<tool_call>{"name":"get_weather","arguments":{"days":2}}'
                                '</tool_call>')  # city is required
    assert not _accepts(hermes, '<tool_call>{"name":"launch","arguments":{}}</tool_call>')
    parallel = TOOL_PARSERS["hermes"]().grammar([TIME], parallel=True)
    assert _accepts(parallel, '<tool_call>{"name":"get_time","arguments":{}}</tool_call>\n'
                              '<tool_call>{"name":"get_time","arguments":{}}</tool_call>')
    llama = TOOL_PARSERS["llama3_json"]().grammar([WEATHER], parallel=False)
    assert _accepts(llama, '{"name":"get_weather","parameters":{"city":"Rome"}}')

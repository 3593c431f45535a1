"""Tool-call formats: parsing answers, and grammars that accept exactly valid calls."""
from __future__ import annotations

import json

import llguidance
import pytest

from kvserve.default_model import default_model_dir
from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kvserve.entrypoints.openai.tools import ToolCallStream, ToolPlan, extract_calls

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


# one answer per format: text before (where the format has any) and two calls
ANSWERS = {
    "hermes": ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
               '"days": 2}}\n</tool_call>\n<tool_call>{"arguments": {}, "name": "get_time"}'
               '</tool_call>'),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", '
                    '"days": 2}}; {"name": "get_time", "parameters": {}}'),
    "mistral": ('Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", '
                '"days": 2}}, {"name": "get_time", "arguments": {}}]'),
    "pythonic": "[get_weather(city='Oslo', days=2), get_time()]",
}
WANT = [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]


@pytest.mark.parametrize("name", list(ANSWERS))
def test_each_format_parses_its_calls(name):
    content, calls = TOOL_PARSERS[name]().parse(ANSWERS[name])
    assert [(n, json.loads(a)) for n, a in calls] == WANT
    assert content == (None if name in ("llama3_json", "pythonic") else "Checking.")
    assert TOOL_PARSERS[name]().parse("Plain answer [1].") == ("Plain answer [1].", [])


def _stream(name: str, answer: str, size: int, parallel: bool = True):
    """Feed ``answer`` in pieces of ``size`` characters; (content, calls) as a client
    assembles the deltas, and the plan's whole-answer reading."""
    plan = ToolPlan([WEATHER, TIME], [], parallel)
    parser = TOOL_PARSERS[name]()
    stream = ToolCallStream(plan, parser)
    content, calls = "", {}
    for end in list(range(size, len(answer), size)) + [len(answer)]:
        more, deltas = stream.feed(answer[:end], final=end == len(answer))
        content += more
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls and d.function.name
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
    whole_content, whole = extract_calls(plan, parser, answer)
    assert [c[0] for c in calls.values()] == [n for _, n, _ in whole]
    assert [c[1] for c in calls.values()] == [a for _, _, a in whole]
    return content, whole_content, whole


@pytest.mark.parametrize("name", list(ANSWERS))
@pytest.mark.parametrize("size", [1, 3, 8, 1000])
def test_streamed_calls_add_up_to_the_whole_answers(name, size):
    content, whole_content, whole = _stream(name, ANSWERS[name], size)
    assert len(whole) == 2 and content == (whole_content or "")
    assert "tool_call" not in content and "TOOL_CALLS" not in content


@pytest.mark.parametrize("name", list(ANSWERS))
def test_without_parallel_calls_only_the_first_is_kept(name):
    _, _, whole = _stream(name, ANSWERS[name], 5, parallel=False)
    assert [n for _, n, _ in whole] == ["get_weather"]


@pytest.mark.parametrize("name", list(ANSWERS))
def test_an_answer_that_only_looks_like_a_call_streams_as_text(name):
    answer = {"hermes": "Use <tool_call> tags", "mistral": "a [TOOL_CALLS marker",
              "llama3_json": "{not json", "pythonic": "[1, 2] are numbers"}[name]
    content, whole_content, whole = _stream(name, answer, 2)
    assert whole == [] and content == whole_content == answer


def test_a_call_of_an_unknown_function_is_not_sent():
    answer = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    _, _, whole = _stream("hermes", answer, 4)
    assert whole == []


def test_forcing_grammars_of_the_other_formats():
    mistral = TOOL_PARSERS["mistral"]().grammar([WEATHER], parallel=True)
    assert _accepts(mistral, '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Rome"}}, '
                             '{"name":"get_weather","arguments":{"city":"Oslo"}}]')
    assert not _accepts(mistral, '[{"name":"get_weather","arguments":{"city":"Rome"}}]')
    pythonic = TOOL_PARSERS["pythonic"]().grammar([WEATHER, TIME], parallel=True)
    for call in ("[get_weather(city='Oslo', days=2), get_time()]", '[get_weather(city="x")]'):
        assert _accepts(pythonic, call)
        assert TOOL_PARSERS["pythonic"]().parse(call)[1]
    assert not _accepts(pythonic, "[get_weather(town='Oslo')]")  # no such parameter
    assert not _accepts(pythonic, "[launch()]")
    single = TOOL_PARSERS["pythonic"]().grammar([TIME], parallel=False)
    assert not _accepts(single, "[get_time(), get_time()]")

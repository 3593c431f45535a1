"""Structured outputs in the engine: what finishes with `stop` parses and matches its
schema / regex / choice / grammar, with sampling, n > 1, preemption and speculation."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.structured_output import StructuredOutputsParams as Constraint
from tests.helpers import flat_step_cost

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0,
                                              "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string",
                                                                          "maxLength": 5},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "eel"]},
                                      "score": {"type": "number", "minimum": -1,
                                                "maximum": 1}},
     "required": ["kind", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"},
                                                       {"type": "boolean"}]}},
     "required": ["v"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                          "y": {"type": "integer"}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                      "b": {"$ref": "#/$defs/point"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {
        "deep": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                 "required": ["ok"], "additionalProperties": False}},
        "required": ["deep"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def llm():
    return LLM()  # the embedded model: a real tokenizer


def _texts(llm, constraint, n=4, temperature=0.9, max_tokens=160,
           prompt="def main():\n    config = ", repetition_penalty=1.0):
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n, seed=3,
                            structured_outputs=constraint,
                            repetition_penalty=repetition_penalty)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    return [(o.text, o.finish_reason) for o in out.outputs]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_json_schema_outputs_validate(llm, schema):
    results = _texts(llm, Constraint(json=schema))
    finished = [t for t, reason in results if reason == "stop"]
    assert finished, results
    for text in finished:
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_grammar_and_any_object(llm):
    for text, reason in _texts(llm, Constraint(regex=r"[a-z]{2,5}-[0-9]{1,3}")):
        assert reason == "stop" and re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", text)
    for text, reason in _texts(llm, Constraint(choice=["alpha", "beta", "gamma"])):
        assert reason == "stop" and text in ("alpha", "beta", "gamma")
    grammar = 'start: "x" ("+" "x")* "=" NUMBER\nNUMBER: /[0-9]+/'
    for text, reason in _texts(llm, Constraint(grammar=grammar), max_tokens=40):
        assert reason != "stop" or re.fullmatch(r"x(\+x)*=[0-9]+", text), text
    for text, reason in _texts(llm, Constraint(json_object=True)):
        assert reason != "stop" or isinstance(json.loads(text), dict)


@pytest.mark.parametrize("bad, message", [
    (Constraint(regex="[unclosed"), "regex"),
    (Constraint(json={"type": "object", "properties": {"a": {"type": "strung"}}}), "json"),
    (Constraint(grammar="start: undefined_rule"), "grammar"),
])
def test_a_grammar_that_cannot_compile_is_refused(llm, bad, message):
    with pytest.raises(ValueError, match=f"structured_outputs.*{message}"):
        llm.generate("x", SamplingParams(structured_outputs=bad), use_tqdm=False)
    assert llm.engine.kv.stats().num_used_blocks == 0 and not llm.engine.structured.has_any()


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        Constraint(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        Constraint()


def test_the_same_schema_compiles_once(llm):
    backend = llm.engine.structured.backend
    _texts(llm, Constraint(json=SCHEMAS[0]), n=1)
    before = backend.compile.cache_info()
    _texts(llm, Constraint(json=SCHEMAS[0]), n=1)
    after = backend.compile.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


@pytest.mark.parametrize("settings", [
    {"num_kv_blocks": 17, "block_size": 8},  # preemption keeps each matcher valid
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_min": 1}},
], ids=["preempted", "speculative"])
def test_greedy_constrained_output_is_unchanged_by_engine_modes(llm, settings, monkeypatch):
    flat_step_cost(monkeypatch)
    schema = SCHEMAS[5]
    params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=Constraint(
        json=schema))
    prompts = ["def a():\n    x = ", "class B:\n    y = ", "import os\nz = "] * 2
    plain = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    other = LLM(**settings)
    got = [o.outputs[0].text for o in other.generate(prompts, params, use_tqdm=False)]
    assert got == plain
    for text in got:
        jsonschema.validate(json.loads(text), schema)
    if "speculative_config" in settings:
        assert other.engine.speculator.stats.num_draft_tokens > 0
    else:
        assert other.engine.scheduler.num_preemptions > 0, "no preemption: test lost its point"
    assert other.engine.kv.stats().num_used_blocks == 0 and not other.engine.structured.has_any()


def test_a_grammar_that_allows_only_eos_beats_min_tokens_and_bad_words(llm):
    """Other processors never leave a constrained row without a token: the grammar wins."""
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3,
                            structured_outputs=Constraint(choice=["yes", "no"]))
    other = LLM(max_num_seqs=4)
    outs = other.generate(["a", "b"], params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
    tok = other.get_tokenizer()
    banned = SamplingParams(temperature=0.0, max_tokens=8, bad_words_token_ids=[
        tok.encode(w, add_special_tokens=False) for w in ("yes", "no")],
        structured_outputs=Constraint(choice=["yes", "no"]))
    text = other.generate("a", banned, use_tqdm=False)[0].outputs[0].text
    assert text in ("yes", "no")
    assert other.engine.kv.stats().num_used_blocks == 0


@pytest.mark.parametrize("settings", [
    {}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                "prompt_lookup_min": 1}}], ids=["plain", "speculative"])
def test_a_constraint_after_reasoning_leaves_the_thinking_free_and_binds_the_answer(
        llm, settings, monkeypatch):
    """With the model's "thinking" ending at the first newline, that line is what the
    model writes unconstrained, and what follows matches. The prompt's lines are JSON, so
    prompt lookup drafts in both parts."""
    from kvserve.structured_output.reasoning import ReasoningSpan

    flat_step_cost(monkeypatch)
    engine = LLM(**settings) if settings else llm
    schema = SCHEMAS[0]
    constraint = Constraint(json=schema, reasoning=ReasoningSpan(end="\n"))
    prompt = '{"age":20,"name":"Bob"}\n' * 4
    # the model's own repetition penalty: without it, its greedy free line runs on
    penalty = 1.25
    for temperature, n in ((0.0, 1), (0.9, 4)):
        outs = _texts(engine, constraint, n=n, temperature=temperature, prompt=prompt,
                      repetition_penalty=penalty)
        free = _texts(llm, None, n=n, temperature=temperature, prompt=prompt,
                      repetition_penalty=penalty)
        for (text, reason), (free_text, _) in zip(outs, free):
            thinking, newline, answer = text.partition("\n")
            assert reason == "stop" and newline, text
            jsonschema.validate(json.loads(answer), schema)
            assert thinking == free_text.partition("\n")[0]  # same seed, same free part
    if settings:
        assert engine.engine.speculator.stats.num_draft_tokens > 0
    assert not engine.engine.structured.has_any()

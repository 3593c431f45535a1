"""The gate of a constraint that binds what follows a reasoning model's thinking: which
tokens the grammar consumes, and where drafts stop."""
from __future__ import annotations

from kvserve.structured_output.reasoning import (ANSWERING, THINKING, ReasoningGate,
                                                 ReasoningSpan)

PIECES = ["<think>", "hm", "</think>", "{", "}", " ", "</", "think>\n"]


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def test_opened_by_the_prompt_the_grammar_starts_after_the_end_tag():
    gate = ReasoningGate(ReasoningSpan(opened_by_prompt=True))
    assert gate.advance([1, 1], decode) == [] and gate.state == THINKING
    assert gate.advance([6], decode) == []  # half the tag
    assert gate.advance([7, 3], decode) == [3] and gate.state == ANSWERING
    assert gate.advance([4], decode) == [4]


def test_undecided_the_first_token_decides():
    thinks = ReasoningGate(ReasoningSpan(opened_by_prompt=False))
    assert thinks.advance([0], decode) == [] and thinks.state == THINKING
    assert thinks.advance([1, 2], decode) == [] and thinks.state == ANSWERING
    assert thinks.advance([3], decode) == [3]
    answers = ReasoningGate(ReasoningSpan(opened_by_prompt=False))
    assert answers.advance([3, 4], decode) == [3, 4] and answers.state == ANSWERING


def test_drafts_stop_before_the_token_that_ends_the_thinking():
    gate = ReasoningGate(ReasoningSpan(opened_by_prompt=True))
    gate.advance([1], decode)
    assert gate.thinking_drafts([1, 6, 7, 3], decode) == [1, 6]
    assert gate.thinking_drafts([1, 1], decode) == [1, 1]
    undecided = ReasoningGate(ReasoningSpan(opened_by_prompt=False))
    assert undecided.thinking_drafts([0, 1], decode) == []  # its first token needs a mask


def test_the_manager_masks_an_undecided_first_token_then_nothing_while_thinking():
    from pathlib import Path
    from types import SimpleNamespace

    from kvserve.default_model import default_model_dir
    from kvserve.structured_output import StructuredOutputsParams
    from kvserve.structured_output.manager import StructuredOutputManager

    mgr = StructuredOutputManager(Path(default_model_dir()), 8192, [1])
    span = ReasoningSpan(start="def", end="\n", opened_by_prompt=False)
    req = SimpleNamespace(request_id="r", output_token_ids=[], sampling_params=SimpleNamespace(
        structured_outputs=StructuredOutputsParams(json_object=True, reasoning=span)))
    mgr.add(req, mgr.compile(req.sampling_params))
    step = SimpleNamespace(scheduled=[SimpleNamespace(request_id="r", sample=True,
                                                      num_draft_tokens=0, token_ids=[5])])
    tok = mgr.backend.tokenizer
    first = mgr.masks(step)["r"][0]
    brace, opener = tok.tokenize_str("{")[0], tok.tokenize_str("def")[0]
    assert first[brace] and first[opener] and first.sum() < 8192 // 2
    for new in (tok.tokenize_str("def"), tok.tokenize_str(" f(x):"), tok.tokenize_str("\n")):
        req.output_token_ids += new
        mgr.advance([(req, len(new))])
        thinking = "r" not in mgr.masks(step)
        assert thinking == (new != tok.tokenize_str("\n"))
    after = mgr.masks(step)["r"][0]  # the answer's first token: the grammar's alone
    assert after[brace] and not after[opener]

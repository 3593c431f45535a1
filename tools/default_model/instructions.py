"""Instruction pairs built from the corpus itself, so the chat route answers with code.

Every function in a file whose docstring opens with a one-paragraph summary becomes a
pair: the summary, phrased as a request, is the user's turn; the function (dedented,
docstring kept) is the assistant's answer. Pairs inherit their file's split, so no
held-out function is ever trained on, and the held-out pairs are what the chat answers
are judged on (:mod:`tools.default_model.evaluate_default`).
"""
from __future__ import annotations

import ast
import random
import re
import textwrap
from dataclasses import dataclass

# An answer longer than this is left out: the model should learn answers it can finish.
MAX_ANSWER_CHARS = 900
MIN_SUMMARY_CHARS = 12
MAX_SUMMARY_CHARS = 200

REQUEST_FORMS = (
    "Write a Python function: {summary}",
    "Write a function. {summary}",
    "{summary}",
)
EVAL_REQUEST_FORM = REQUEST_FORMS[0]


@dataclass(frozen=True)
class Pair:
    path: str
    name: str
    summary: str
    answer: str
    doctest: str | None  # the docstring when it holds a doctest example

    def request(self, form: str = EVAL_REQUEST_FORM) -> str:
        return form.format(summary=self.summary)


def docstring_summary(doc: str) -> str | None:
    """The docstring's first paragraph on one line, or None when it is not a usable
    request (too short or long, a signature line, an rst directive)."""
    first = doc.strip().split("\n\n", 1)[0]
    summary = re.sub(r"\s+", " ", first).strip()
    if not (MIN_SUMMARY_CHARS <= len(summary) <= MAX_SUMMARY_CHARS):
        return None
    if summary.startswith((":", "..", ">>>")) or re.match(r"^\w+\(.*\)\s*(->.*)?$", summary):
        return None
    return summary


def file_pairs(path: str, text: str) -> list[Pair]:
    """Every usable (summary, function) pair of one source file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        summary = docstring_summary(doc)
        source = ast.get_source_segment(text, node, padded=True)
        if summary is None or source is None:
            continue
        if node.decorator_list:  # the decorators belong to the answer
            first = node.decorator_list[0]
            lines = text.splitlines(keepends=True)
            source = "".join(lines[first.lineno - 1 : node.end_lineno])
        answer = textwrap.dedent(source).rstrip() + "\n"
        if len(answer) > MAX_ANSWER_CHARS:
            continue
        try:
            ast.parse(answer)
        except SyntaxError:
            continue
        pairs.append(Pair(path, node.name, summary, answer, doc if ">>>" in doc else None))
    return pairs


def corpus_pairs(docs: dict[str, str], paths: list[str]) -> list[Pair]:
    return [pair for path in paths for pair in file_pairs(path, docs[path])]


def chat_text(request: str, answer: str) -> str:
    """One exchange as the chat template renders it, after its bos and before its eos
    (the packer adds both)."""
    return f"<|user|>\n{request}\n<|assistant|>\n{answer}"


def training_texts(pairs: list[Pair], seed: int) -> list[str]:
    """Each pair once, its request in a form drawn with ``seed``."""
    rng = random.Random(seed)
    return [chat_text(p.request(rng.choice(REQUEST_FORMS)), p.answer) for p in pairs]

"""Tool calling in chat completions: which tools a request offers and must use, the
conversation as the chat template sees it, and the calls parsed out of the answer.

``tool_choice`` ``required`` or a named function is enforced by a grammar (the model
can only write a call in the parser's format, arguments valid against the function's
``parameters``); ``auto`` lets the model choose, and its answer is parsed; ``none``
hides the tools.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from kvserve.entrypoints.openai.errors import bad_request
from kvserve.structured_output import StructuredOutputsParams


@dataclass(frozen=True)
class ToolPlan:
    functions: list[dict]   # what the template shows
    forced: list[dict]      # what the grammar allows (empty: the model chooses)
    parallel: bool


def plan_tools(req, tokenizer) -> ToolPlan | None:
    """None: no tools in play. Refuses inconsistent requests with a 400."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    if choice is None or choice == "auto":
        if not tokenizer.renders_tools:
            raise bad_request("this model's chat template does not show it tools, so it "
                              "cannot choose to call one; use tool_choice 'required' or a "
                              "named function", "tool_choice")
        return ToolPlan(functions, [], req.parallel_tool_calls)
    if choice == "required":
        return ToolPlan(functions, functions, req.parallel_tool_calls)
    chosen = [f for f in functions if f["name"] == choice.function.name]
    if not chosen:
        raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among "
                          f"the tools ({', '.join(names)})", "tool_choice")
    return ToolPlan(functions, chosen, False)


def forced_call(plan: ToolPlan | None, parser) -> StructuredOutputsParams | None:
    if plan is None or not plan.forced:
        return None
    return StructuredOutputsParams(grammar=parser.grammar(plan.forced, plan.parallel))


def conversation(messages) -> list[dict]:
    """Messages as the chat template reads them (tool calls' arguments as objects)."""
    out = []
    for m in messages:
        entry = {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    arguments = json.loads(c.function.arguments)
                except json.JSONDecodeError:
                    raise bad_request("a tool call's arguments must be JSON text",
                                      "messages") from None
                calls.append({"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": arguments}})
            entry["tool_calls"] = calls
        if m.tool_call_id:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def extract_calls(plan: ToolPlan | None, parser, text: str
                  ) -> tuple[str | None, list[tuple[str, str, str]]]:
    """(content, [(call id, name, arguments JSON)]) of an answer."""
    if plan is None:
        return text, []
    content, calls = parser.parse(text)
    known = {f["name"] for f in plan.functions}
    calls = [(f"call_{uuid.uuid4().hex[:24]}", name, args) for name, args in calls
             if name in known]
    return (content if calls else text), calls

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
from kvserve.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall
from kvserve.structured_output import StructuredOutputsParams


@dataclass(frozen=True)
class ToolPlan:
    functions: list[dict]   # what the template shows
    forced: list[dict]      # what the grammar allows (empty: the model chooses)
    parallel: bool


def plan_tools(req, tokenizer, chat_template: str | None = None,
               auto: bool = True) -> ToolPlan | None:
    """None: no tools in play. Refuses inconsistent requests with a 400. ``auto``: the
    model may choose whether to call (``--enable-auto-tool-choice``)."""
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
        if not auto:
            raise bad_request("tool_choice 'auto' needs --enable-auto-tool-choice; this "
                              "server was started with --no-enable-auto-tool-choice",
                              "tool_choice")
        if not tokenizer.renders_tools(chat_template):
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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def extract_calls(plan: ToolPlan | None, parser, text: str
                  ) -> tuple[str | None, list[tuple[str, str, str]]]:
    """(content, [(call id, name, arguments JSON)]) of a whole answer: calls of the
    offered functions only, and only the first unless parallel calls are allowed."""
    if plan is None:
        return text, []
    content, calls = parser.parse(text)
    known = {f["name"] for f in plan.functions}
    calls = [(new_call_id(), name, args) for name, args in calls if name in known]
    if not plan.parallel:
        calls = calls[:1]
    return (content if calls else text), calls


class ToolCallStream:
    """One choice's answer as it is written, sent as content and ``tool_calls`` deltas:
    a call's first delta names it once its name is whole, later ones carry its
    arguments' text as it grows. Whole calls add up to what :func:`extract_calls`
    finds in the whole answer; text that might open a call is held back, and so is
    trailing whitespace (dropped beside calls, as the whole answer's content is)."""

    def __init__(self, plan: ToolPlan, parser) -> None:
        self.plan, self.parser = plan, parser
        self.known = {f["name"] for f in plan.functions}
        self.slots: list[list[int] | None] = []  # per call read: [index, chars sent]
        self.num_calls = 0
        self.sent = ""  # the content sent so far

    def feed(self, answer: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """``answer``: the whole answer so far -> (more content, call deltas)."""
        content, calls = self.parser.scan(answer, final)
        deltas = []
        for i, call in enumerate(calls):
            if i == len(self.slots):
                if call.name is None:
                    break  # later calls wait, so indexes follow the answer's order
                wanted = call.name in self.known and (self.plan.parallel
                                                      or not self.num_calls)
                self.slots.append([self.num_calls, len(call.arguments)] if wanted else None)
                if wanted:
                    deltas.append(DeltaToolCall(
                        index=self.num_calls, id=new_call_id(), type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                    self.num_calls += 1
                continue
            slot = self.slots[i]
            if slot is not None and len(call.arguments) > slot[1]:
                deltas.append(DeltaToolCall(index=slot[0], function=DeltaFunctionCall(
                    arguments=call.arguments[slot[1]:])))
                slot[1] = len(call.arguments)
        if final and not self.num_calls:  # no call after all: the answer is all text
            more = (answer if answer.startswith(self.sent) else content)[len(self.sent):]
        else:
            end = len(content.rstrip())
            more = content[len(self.sent):end] if end > len(self.sent) else ""
        self.sent += more
        return more, deltas

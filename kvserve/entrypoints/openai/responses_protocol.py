"""OpenAI's Responses API request, the stateless subset kvserve serves, and its reading
as a chat request: ``instructions`` and ``input`` (text, messages, earlier function calls
and their outputs) become the conversation, function ``tools`` and ``tool_choice`` the
chat's, ``text.format`` the response format. What needs a stored response
(``previous_response_id``, ``store``, ``background``, ``conversation``) is refused by
name: kvserve keeps no responses."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.entrypoints.openai.errors import bad_request
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage

STORED = ("previous_response_id", "conversation", "background")
NOT_IMPLEMENTED = ("reasoning", "include", "top_logprobs", "prompt", "max_tool_calls",
                   "prompt_cache_key", "service_tier", "safety_identifier")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None


class InputMessage(_Request):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # what kvserve does not do: accepted by name only to refuse it with a reason
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: Any = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    prompt: Any = None
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None

    def check_supported(self) -> None:
        for name in STORED:
            if getattr(self, name):
                raise bad_request(f"{name} needs a stored response; kvserve keeps none "
                                  "(send the whole conversation as input)", name)
        if self.store:
            raise bad_request("store: kvserve keeps no responses; leave store unset or "
                              "false", "store")
        for name in NOT_IMPLEMENTED:
            if getattr(self, name):
                raise bad_request(f"{name} is not implemented by kvserve's Responses API",
                                  name)
        if self.text is not None and self.text.verbosity is not None:
            raise bad_request("text.verbosity is not implemented by kvserve's Responses API",
                              "text")


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def as_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request the Responses request amounts to."""
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) \
        else req.input
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
    if not messages:
        raise bad_request("input must not be empty", "input")
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None and fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None or not fmt.name:
            raise bad_request("text.format json_schema needs a name and a schema", "text")
        response_format = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    choice = req.tool_choice
    return ChatCompletionRequest.model_validate({
        "messages": [ChatMessage.model_validate(m) for m in messages],
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                  exclude_none=True)}
                  for t in req.tools] if req.tools else None,
        "tool_choice": ({"type": "function", "function": {"name": choice.name}}
                        if isinstance(choice, FunctionChoice) else choice),
        "response_format": response_format}, strict=False)

"""Pydantic models of the OpenAI protocol (requests strict, responses in OpenAI's shapes).

Requests are validated from the raw JSON body in strict mode: a string where a number
is expected is an error, not a conversion. vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, priority, ...) are accepted.
A field not declared here is refused (400 naming it), never ignored: ignoring one would
answer a different question than the client asked with 200 OK. ``user`` and
``metadata``, which change nothing about the answer, are accepted.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

MAX_N = 128
MAX_PROMPTS = 256
MAX_LOGPROBS = 20


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False



class JsonSchemaFormat(_Request):
    name: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's structured_outputs object: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=300)
    user: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last N; -1: the most
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and the
    # older guided_* fields (vLLM now ignores those silently; kvserve honours them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    bad_words: list[str] | None = Field(None, max_length=256)  # never generated


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM extra
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    # vLLM's beam search: best_of beams (default n), n hypotheses returned
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None           # a tool's answer to one of them

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request (``user`` accepted and unused, as OpenAI's)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # each token's vocabulary piece, as vLLM's


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- responses ---------------------------------------------------------------------------

def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's shape: per prompt token (the first None), token id -> its logprob
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None

    @model_serializer(mode="wrap")
    def _omit_prompt_logprobs(self, handler):
        data = handler(self)
        if data.get("prompt_logprobs") is None:
            data.pop("prompt_logprobs", None)
        return data


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the model's thinking
    refusal: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first delta only
    arguments: str | None = None  # the next piece of the arguments' JSON text

    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A piece of the ``index``-th call: the first carries its id and name, the rest
    more of its arguments, as OpenAI streams them."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> dict[str, Any]:  # OpenAI's deltas omit absent fields
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvserve"
    root: str | None = None     # where its weights come from (a LoRA adapter's directory)
    parent: str | None = None   # a LoRA adapter's base model
    max_model_len: int | None = None
    # the sampling fields a request leaving them unset gets (--generation-config)
    default_sampling_params: dict[str, Any] = Field(default_factory=dict)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(_Request):
    """vLLM's body of POST /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's body of POST /v1/unload_lora_adapter (``lora_int_id``: checked if given)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None

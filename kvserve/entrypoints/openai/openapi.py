"""The server's OpenAPI document, written from the same pydantic models that validate
requests and build responses, so it cannot drift from what the server does. Routes are
plain Starlette ones (bodies are read and validated by hand: strict JSON, size limits),
which FastAPI cannot describe on its own."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kvserve.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                                 CompletionRequest, CompletionResponse,
                                                 DetokenizeRequest, EmbeddingRequest,
                                                 EmbeddingResponse, LoadLoRAAdapterRequest,
                                                 ModelCard, ModelList, TokenizeRequest,
                                                 UnloadLoRAAdapterRequest)
from kvserve.entrypoints.openai.responses_protocol import ResponsesRequest

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}}}
_HEALTH = {"type": "object", "required": ["status", "native_kernels"], "properties": {
    "status": {"const": "ok"},
    "native_kernels": {"type": "object", "required": ["compiled", "reason"], "properties": {
        "compiled": {"type": "boolean"},  # false: the slower torch paths run
        "reason": {"type": "string"}}}}}  # why they did not build ("" when they did)
_ERRORS = {"400": "invalid request", "401": "missing or wrong API key",
           "404": "unknown model or route", "405": "wrong method",
           "413": "body too large", "415": "not JSON", "429": "too many waiting requests",
           "500": "internal error", "503": "engine not running"}


class _Schemas:
    """Collects model schemas into components, referenced by name."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {"Error": _ERROR}

    def ref(self, model: type[BaseModel], mode: str) -> dict:
        schema = model.model_json_schema(mode=mode,
                                         ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            self.components.setdefault(name, sub)
        self.components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}


def _operation(summary: str, ok: dict, errors: tuple[str, ...],
               body: dict | None = None) -> dict:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": ok}}
    for code in errors:
        op["responses"][code] = {"description": _ERRORS[code], "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


def build_openapi(version: str, protected: bool) -> dict:
    s = _Schemas()
    auth = ("401",) if protected else ()
    body_errors = ("400", "404", "413", "415", "429", "500", "503", *auth)
    stream = {"text/event-stream": {"schema": {}}}  # each event: a chunk, or [DONE]

    def json_ok(schema: dict, streaming: bool = False) -> dict:
        content = {"application/json": {"schema": schema}, **(stream if streaming else {})}
        return {"description": "success", "content": content}
    text_ok = {"description": "success", "content": {"text/plain": {"schema": {
        "type": "string"}}}}

    paths = {
        "/v1/completions": {"post": _operation(
            "OpenAI completions", json_ok(s.ref(CompletionResponse, "serialization"), True),
            body_errors, s.ref(CompletionRequest, "validation"))},
        "/v1/chat/completions": {"post": _operation(
            "OpenAI chat completions",
            json_ok(s.ref(ChatCompletionResponse, "serialization"), True), body_errors,
            s.ref(ChatCompletionRequest, "validation"))},
        "/v1/responses": {"post": _operation(
            "OpenAI responses (stateless)", json_ok({"type": "object"}, True), body_errors,
            s.ref(ResponsesRequest, "validation"))},
        "/v1/embeddings": {"post": _operation(
            "OpenAI embeddings", json_ok(s.ref(EmbeddingResponse, "serialization")),
            body_errors, s.ref(EmbeddingRequest, "validation"))},
        "/v1/load_lora_adapter": {"post": _operation(
            "serve a LoRA adapter", text_ok, ("400", "413", "415", "500", "503", *auth),
            s.ref(LoadLoRAAdapterRequest, "validation"))},
        "/v1/unload_lora_adapter": {"post": _operation(
            "stop serving a LoRA adapter", text_ok, ("400", "404", "413", "415", "500", "503",
                                                     *auth),
            s.ref(UnloadLoRAAdapterRequest, "validation"))},
        "/tokenize": {"post": _operation("token ids of a prompt or conversation", json_ok(
            {"type": "object"}), ("400", "404", "413", "415", *auth),
            s.ref(TokenizeRequest, "validation"))},
        "/detokenize": {"post": _operation("text of token ids", json_ok({"type": "object"}),
                                           ("400", "404", "413", "415", *auth),
                                           s.ref(DetokenizeRequest, "validation"))},
        "/v1/models": {"get": _operation("the served model", json_ok(
            s.ref(ModelList, "serialization")), auth)},
        "/v1/models/{model}": {"get": {**_operation("one model", json_ok(
            s.ref(ModelCard, "serialization")), ("404", *auth)), "parameters": [
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]}},
        "/health": {"get": _operation("200 while the engine runs", json_ok(_HEALTH),
                                      ("503",))},
        "/version": {"get": _operation("package version", json_ok({"type": "object"}), ())},
        "/metrics": {"get": _operation("Prometheus metrics", {"description": "exposition",
                                       "content": {"text/plain": {"schema": {
                                           "type": "string"}}}}, ("404",))},
    }
    return {"openapi": "3.1.0", "info": {"title": "kvserve", "version": version},
            "paths": paths, "components": {"schemas": s.components}}

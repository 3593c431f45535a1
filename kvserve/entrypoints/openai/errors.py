"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Every client mistake becomes an :class:`APIError` (4xx); handlers never let one turn
into a 500. Validation errors of the pydantic request models are translated here so
that the message names the offending parameter.
"""
from __future__ import annotations

import json
from http import HTTPStatus

from pydantic import ValidationError
from starlette.responses import JSONResponse

# OpenAI's error types by status (code is set where OpenAI sets one).
_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    429: "rate_limit_error", 500: "server_error", 503: "server_error",
}

# Friendlier messages for fields whose pydantic union errors read poorly.
_FIELD_HINTS = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list "
              "of token-id lists",
    "stop": "stop must be a string or a list of strings",
    "messages": "messages must be a non-empty list of {role, content} objects",
}


class APIError(Exception):
    """An error answered to the client with OpenAI's body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.err_type = err_type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> str:
        """The error as a server-sent event (a failure in the middle of a stream)."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param=param)


# OpenAI and vLLM request fields this server knows but does not implement: refused with
# the reason, so that a client never gets an answer that silently ignored them
UNSUPPORTED_FIELDS = {
    "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented",
    "prompt_logprobs": "prompt logprobs are served by /v1/completions only",
    "audio": "the served models have no audio output",
    "modalities": "the served models produce text only",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "the served models do not reason in a separate channel",
    "web_search_options": "web search is not available",
    "store": "stored completions are not available",
    "service_tier": "there is one service tier",
    "logprobs_mode": "logprobs are of the raw model distribution",
    "echo": "chat echo is not implemented yet",
}


def from_validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    first = extra[0] if extra else errors[0]
    if first["type"] == "extra_forbidden":
        path = ".".join(str(p) for p in first["loc"])
        name = str(first["loc"][-1])
        if len(first["loc"]) == 1 and name in UNSUPPORTED_FIELDS:
            return APIError(f"'{name}' is not supported by this server: "
                            f"{UNSUPPORTED_FIELDS[name]}", 400, param=name)
        return APIError(f"Unrecognized request argument supplied: {path}", 400, param=path)
    if first["type"] == "json_invalid":
        return APIError(f"request body is not valid JSON: {first['msg']}", 400)
    loc = [str(p) for p in first["loc"]]
    if not loc:  # the top level: not an object
        return APIError(f"request body must be a JSON object: {first['msg']}", 400)
    if first["type"] == "missing":
        return APIError(f"missing required parameter '{loc[0]}'", 400, param=loc[0])
    field = loc[0]
    union_failure = len(errors) > 1 and all(str(e["loc"][0]) == field for e in errors if e["loc"])
    if union_failure and field in _FIELD_HINTS:
        return APIError(f"{_FIELD_HINTS[field]} ({first['msg'].lower()})", 400, param=field)
    # drop pydantic's union member tags (e.g. "list[int]") from the dotted path
    path = ".".join(p for p in loc if "[" not in p and p not in ("str", "int", "float"))
    value = first.get("input")
    shown = "" if isinstance(value, (dict, list)) or value is None else f", got {value!r:.80}"
    return APIError(f"invalid value for '{path}': {first['msg']}{shown}", 400, param=path)


def from_value_error(exc: ValueError, known_params: set[str] | frozenset = frozenset()
                     ) -> APIError:
    """SamplingParams / engine ValueErrors: their messages start with the field name."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    return APIError(message, 400, param=first if first in known_params else None)


def http_status_error(status: int, detail: str | None = None) -> APIError:
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return APIError(detail or phrase, status, code=code)


def internal_error(message: str = "internal server error") -> APIError:
    return APIError(message, 500, err_type="server_error", code="internal_error")


def engine_error(exc: Exception) -> APIError:
    """An EngineRequestError: 500 (failed in the engine) or 503 (aborted at shutdown)."""
    status = getattr(exc, "status", 500)
    if status == 503:
        return APIError(str(exc), 503, err_type="server_error", code="server_shutting_down")
    return internal_error(str(exc))

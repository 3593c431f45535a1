"""Reading a request body: content type, size limit, strict JSON into a protocol model."""
from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from kvserve.entrypoints.openai.errors import APIError, bad_request, from_validation_error

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, max_bytes: int) -> bytes:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(f"Content-Type must be application/json, got {ctype!r}", 415)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(f"request body of {int(length)} bytes exceeds the limit of "
                       f"{max_bytes} bytes", 413, code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(f"request body exceeds the limit of {max_bytes} bytes", 413,
                               code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError("client disconnected while sending the body", 400) from None
    return b"".join(chunks)


async def parse_request(request: Request, model_cls: type[M], max_bytes: int) -> M:
    body = await read_body(request, max_bytes)
    if not body.strip():
        raise bad_request("request body is empty: send a JSON object")
    try:
        return model_cls.model_validate_json(body, strict=True)
    except ValidationError as e:
        raise from_validation_error(e) from None

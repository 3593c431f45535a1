"""The OpenAI Files and Batch API: ``/v1/files`` and ``/v1/batches``.

Lines run in-process through the same completions / chat handlers as HTTP requests,
marked as batch lines on their ASGI scope (clients cannot set that), which makes them
background requests for the scheduler.
"""
from __future__ import annotations

import asyncio
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.batch.lines import BATCH_SCOPE_KEY, ENDPOINTS, MAX_FILE_BYTES, MAX_LINES, \
    parse_input
from kvserve.batch.runner import BatchRunner
from kvserve.batch.store import BatchStore
from kvserve.entrypoints.openai.errors import APIError, bad_request
from kvserve.entrypoints.openai.request_body import parse_request

FILE_PURPOSES = ("batch",)


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def make_executor(ctx, handlers: dict):
    """``execute(endpoint, body)``: run one line through the server's handler."""
    async def execute(endpoint: str, body: dict) -> tuple[int, str, object]:
        data = json.dumps(body).encode()
        scope = {"type": "http", "method": "POST", "path": endpoint, "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], BATCH_SCOPE_KEY: True}
        sent = False

        async def receive():
            nonlocal sent
            if sent:  # the "client" never leaves: a line ends only when it is done
                await asyncio.Event().wait()
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}

        try:
            response = await handlers[endpoint](Request(scope, receive), ctx)
        except APIError as e:
            return e.status, "", e.body()
        out = json.loads(response.body)
        return response.status_code, out.get("id", "") if isinstance(out, dict) else "", out
    return execute


def _page(items: list, has_more: bool) -> dict:
    return {"object": "list", "data": items, "has_more": has_more,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None}


def _limit(request: Request, default: int = 20) -> int:
    raw = request.query_params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= 10_000:
        raise bad_request(f"limit must be an integer in [1, 10000], got {raw!r}", "limit")
    return int(raw)


def add_batch_routes(route, store: BatchStore, runner: BatchRunner,
                     max_file_bytes: int = MAX_FILE_BYTES, max_body_bytes: int = 2**20) -> None:
    """Register the routes with ``route(path, method)`` (the server's decorator)."""

    def find_file(file_id: str) -> dict:
        found = store.file(file_id)
        if found is None:
            raise APIError(f"No such File object: {file_id}", 404, param="file_id")
        return found

    def find_batch(batch_id: str) -> dict:
        found = store.batch(batch_id)
        if found is None:
            raise APIError(f"No such Batch object: {batch_id}", 404, param="batch_id")
        return found

    @route("/v1/files", "POST")
    async def upload(request: Request) -> Response:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError("upload a file as multipart/form-data with fields 'file' and "
                           "'purpose'", 415)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_file_bytes + 65536:
            raise APIError(f"files are limited to {max_file_bytes} bytes on this server", 413,
                           code="file_too_large")
        try:  # a malformed form, or more parts than allowed: Starlette's 400, else a 500
            form = await request.form(max_files=1, max_fields=4)
        except HTTPException as e:
            raise bad_request(f"invalid multipart form: {e.detail}") from None
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose not in FILE_PURPOSES:
                raise bad_request(f"purpose must be one of {list(FILE_PURPOSES)}, got "
                                  f"{purpose!r}", "purpose")
            if upload is None or isinstance(upload, str):
                raise bad_request("the form has no 'file' part", "file")
            data = await upload.read()
            name = upload.filename or "upload.jsonl"
        finally:
            await form.close()
        if len(data) > max_file_bytes:
            raise APIError(f"files are limited to {max_file_bytes} bytes on this server, this "
                           f"one has {len(data)}", 413, code="file_too_large")
        return JSONResponse(store.add_file(purpose, name, data))

    @route("/v1/files", "GET")
    async def list_files(request: Request) -> Response:
        try:
            items, more = store.files(request.query_params.get("purpose"),
                                      request.query_params.get("after"), _limit(request, 100))
        except KeyError as e:
            raise bad_request(f"after: no such file {e.args[0]!r}", "after") from None
        return JSONResponse(_page(items, more))

    @route("/v1/files/{file_id}", "GET")
    async def get_file(request: Request) -> Response:
        return JSONResponse(find_file(request.path_params["file_id"]))

    @route("/v1/files/{file_id}", "DELETE")
    async def delete_file(request: Request) -> Response:
        file_id = request.path_params["file_id"]
        find_file(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": store.delete_file(file_id)})

    @route("/v1/files/{file_id}/content", "GET")
    async def file_content(request: Request) -> Response:
        file_id = request.path_params["file_id"]
        find_file(file_id)
        data = await asyncio.to_thread(store.file_path(file_id).read_bytes)
        return Response(data, media_type="application/octet-stream")

    @route("/v1/batches", "POST")
    async def create_batch(request: Request) -> Response:
        req = await parse_request(request, CreateBatchRequest, max_body_bytes)
        source = find_file(req.input_file_id)
        if source["purpose"] != "batch":
            raise bad_request(f"file {req.input_file_id} has purpose {source['purpose']!r}; "
                              "a batch reads a file uploaded with purpose 'batch'",
                              "input_file_id")
        data = await asyncio.to_thread(store.file_path(req.input_file_id).read_bytes)
        lines, errors = await asyncio.to_thread(parse_input, data, req.endpoint, MAX_LINES)
        batch = store.create_batch(req.input_file_id, req.endpoint, req.completion_window,
                                   req.metadata, lines, errors)
        runner.wake()
        return JSONResponse(batch)

    @route("/v1/batches", "GET")
    async def list_batches(request: Request) -> Response:
        try:
            items, more = store.batches(request.query_params.get("after"), _limit(request))
        except KeyError as e:
            raise bad_request(f"after: no such batch {e.args[0]!r}", "after") from None
        return JSONResponse(_page(items, more))

    @route("/v1/batches/{batch_id}", "GET")
    async def get_batch(request: Request) -> Response:
        return JSONResponse(find_batch(request.path_params["batch_id"]))

    @route("/v1/batches/{batch_id}/cancel", "POST")
    async def cancel_batch(request: Request) -> Response:
        batch = find_batch(request.path_params["batch_id"])
        if batch["status"] not in ("validating", "in_progress"):
            raise APIError(f"batch {batch['id']} is {batch['status']}; only a validating or "
                           "in-progress batch can be cancelled", 409)
        store.set_status(batch["id"], "cancelling")
        runner.wake()
        return JSONResponse(store.batch(batch["id"]))


__all__ = ["ENDPOINTS", "add_batch_routes", "make_executor"]

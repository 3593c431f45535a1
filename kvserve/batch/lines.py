"""The Batch API's JSONL: input lines checked one by one, output and error lines.

An input line is ``{"custom_id", "method": "POST", "url": <the batch's endpoint>,
"body": {...}}``, as OpenAI's. Every problem is reported with its line number, as
OpenAI's ``errors`` list of a failed batch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
MAX_LINES = 50_000                # OpenAI's limits on one batch's input file
MAX_FILE_BYTES = 200 * 2**20
BATCH_SCOPE_KEY = "kvserve.batch_line"  # set on the ASGI scope of a line run in-process


def is_batch_line(request) -> bool:
    """Whether an HTTP handler is running a batch line (never true for a client's
    request: clients cannot set ASGI scope keys)."""
    return bool(request.scope.get(BATCH_SCOPE_KEY))


@dataclass(frozen=True)
class InputLine:
    line: int          # 1-based, as reported to users
    custom_id: str
    body: dict


def _error(line: int, code: str, message: str, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_input(data: bytes, endpoint: str, max_lines: int = MAX_LINES
                ) -> tuple[list[InputLine], list[dict]]:
    """The lines of a batch input file and the errors found in it (empty if valid)."""
    lines: list[InputLine] = []
    errors: list[dict] = []
    seen: set[str] = set()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], [_error(1, "invalid_file", f"the file is not UTF-8: {e}")]
    rows = [r for r in enumerate(text.splitlines(), start=1) if r[1].strip()]
    if not rows:
        return [], [_error(1, "empty_file", "the input file has no lines")]
    if len(rows) > max_lines:
        return [], [_error(rows[max_lines][0], "too_many_lines",
                           f"a batch has at most {max_lines} lines, this file has {len(rows)}")]
    for number, raw in rows:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(_error(number, "invalid_json", f"line {number} is not JSON: {e.msg}"))
            continue
        problem = _check_line(obj, endpoint, seen)
        if problem:
            errors.append(_error(number, *problem))
            continue
        seen.add(obj["custom_id"])
        lines.append(InputLine(number, obj["custom_id"], obj["body"]))
    return lines, errors


def _check_line(obj, endpoint: str, seen: set[str]) -> tuple[str, str, str] | None:
    if not isinstance(obj, dict):
        return "invalid_request", "each line must be a JSON object", None
    extra = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if extra:
        return ("invalid_request", f"unknown field {extra[0]!r}: a line has custom_id, "
                "method, url and body", extra[0])
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_custom_id", "custom_id must be a non-empty string", "custom_id"
    if custom_id in seen:
        return ("duplicate_custom_id", f"custom_id {custom_id!r} appears more than once",
                "custom_id")
    if obj.get("method") != "POST":
        return "invalid_method", f"method must be 'POST', got {obj.get('method')!r}", "method"
    if obj.get("url") != endpoint:
        return ("invalid_url", f"url must be the batch's endpoint {endpoint!r}, got "
                f"{obj.get('url')!r}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return "invalid_body", "body must be a JSON object (the request)", "body"
    if body.get("stream"):
        return "invalid_body", "batch lines cannot stream: drop 'stream'", "body.stream"
    return None


def output_line(line_id: str, custom_id: str, status: int, request_id: str, body) -> dict:
    """A line of the output file (2xx) or the error file (other statuses)."""
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}


def unrun_line(line_id: str, custom_id: str, code: str, message: str) -> dict:
    """A line the batch never ran (expired, cancelled): error file, no response."""
    return {"id": line_id, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}

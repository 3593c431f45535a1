"""``kvserve run-batch``: run a Batch API input file offline, as vLLM's ``vllm run-batch``.

The input and output are local JSONL files. Input lines are the Batch API's
(``{"custom_id", "method": "POST", "url", "body"}``), but unlike a server batch one file
may mix ``/v1/completions`` and ``/v1/chat/completions`` lines. The whole file is checked
first; if any line is invalid every problem is printed with its line number and nothing
runs. Otherwise the model is loaded once and every line runs through the server's own
completions / chat handlers in-process (:func:`make_executor`), so a response body is
exactly what ``kvserve serve`` would have answered, error bodies included. Lines run
concurrently, at most a few times ``max_num_seqs`` at once: the scheduler always has a
full batch waiting while memory stays bounded on files of any size. The output file
has one line per input line, in input order (successes and errors alike, each with its
status), written to a temporary file that replaces ``OUT`` only once every line is done.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvserve.batch.lines import ENDPOINTS, InputLine, output_line, parse_input
from kvserve.config import ObservabilityConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.engine_args import EngineArgs
from kvserve.entrypoints.openai.api_server import served_name
from kvserve.entrypoints.openai.batch_routes import make_executor
from kvserve.entrypoints.openai.context import ServerContext
from kvserve.entrypoints.openai.errors import internal_error
from kvserve.entrypoints.openai.serving_chat import create_chat_completion
from kvserve.entrypoints.openai.serving_completions import create_completion
from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kvserve.logger import init_logger

logger = init_logger(__name__)

# parse_input's errors about the file as a whole (the same for every endpoint)
_FILE_ERRORS = ("invalid_file", "empty_file", "too_many_lines")
IN_FLIGHT_PER_SEQ = 4  # lines in flight per max_num_seqs


@dataclass(frozen=True)
class BatchLine:
    endpoint: str
    line: InputLine


@dataclass
class BatchSummary:
    lines: int = 0
    ok: int = 0
    failed: int = 0
    seconds: float = 0.0
    output_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"lines": self.lines, "ok": self.ok, "failed": self.failed,
                "seconds": self.seconds, "output_tokens": self.output_tokens,
                "output_tokens_per_s": self.tokens_per_s}

    def __str__(self) -> str:
        return (f"{self.lines} lines: {self.ok} ok, {self.failed} failed in "
                f"{self.seconds:.1f}s ({self.output_tokens} output tokens, "
                f"{self.tokens_per_s:.1f} tokens/s)")


def parse_mixed_input(data: bytes, max_lines: int = sys.maxsize
                      ) -> tuple[list[BatchLine], list[dict]]:
    """The lines of an input file whose lines may use any of ``ENDPOINTS``, each with its
    endpoint, and the errors found (empty if valid), both in line order.

    :func:`parse_input` checks a file for one endpoint; a line is valid here if it is valid
    for one of them. A line invalid for all is reported with its first error other than
    the url mismatch (that one says which endpoint it expected), or as an unknown url.
    custom_ids must be unique over the whole file, across endpoints too.
    """
    valid: dict[int, BatchLine] = {}
    errors: dict[int, list[dict]] = {}
    for endpoint in ENDPOINTS:
        lines, errs = parse_input(data, endpoint, max_lines)
        file_errors = [e for e in errs if e["code"] in _FILE_ERRORS]
        if file_errors:
            return [], file_errors
        for line in lines:
            valid.setdefault(line.line, BatchLine(endpoint, line))
        for e in errs:
            errors.setdefault(e["line"], []).append(e)
    out: list[dict] = []
    for number in sorted(set(errors) - set(valid)):
        found = [e for e in errors[number] if e["code"] != "invalid_url"]
        out.append(found[0] if found else _url_error(data, errors[number][0]))
    lines = []
    seen: set[str] = set()
    for number in sorted(valid):
        custom_id = valid[number].line.custom_id
        if custom_id in seen:  # once for one endpoint, again for another
            out.append({"code": "duplicate_custom_id", "param": "custom_id", "line": number,
                        "message": f"custom_id {custom_id!r} appears more than once"})
            continue
        seen.add(custom_id)
        lines.append(valid[number])
    out.sort(key=lambda e: e["line"])
    return lines, out


def _url_error(data: bytes, error: dict) -> dict:
    """parse_input's url error names one endpoint; say that any of ENDPOINTS would do."""
    row = data.decode("utf-8").splitlines()[error["line"] - 1]
    return {**error, "message": f"url must be one of {list(ENDPOINTS)}, got "
                                f"{json.loads(row).get('url')!r}"}


def format_error(path: str, error: dict) -> str:
    return f"{path}:{error['line']}: {error['code']}: {error['message']}"


def run_batch(input_path: str, output_path: str, engine_args, served_model_name: str, *,
              tool_call_parser: str = "hermes", max_in_flight: int | None = None,
              progress: bool | None = None, summary_json: str | None = None) -> int:
    """Run every line of ``input_path`` and write ``output_path``; the exit status.

    1 if the input file has invalid lines (each printed on stderr, nothing run, no output
    written) or if the engine died while running; 130 if interrupted (Ctrl-C: no output
    written); 0 otherwise, whatever the lines'
    statuses (a failed line is an output line with its error status, as on the server).
    ``max_in_flight``: lines running at once (default ``4 x max_num_seqs``);
    ``progress``: show a tqdm bar (default: when stderr is a terminal);
    ``summary_json``: also write the summary there (``seconds`` excludes the model load).
    """
    data = Path(input_path).read_bytes()
    lines, errors = parse_mixed_input(data)
    if errors:
        for e in errors:
            print(format_error(input_path, e), file=sys.stderr)
        print(f"{input_path}: {len(errors)} invalid line(s); nothing was run",
              file=sys.stderr)
        return 1
    out_dir = Path(output_path).resolve().parent
    if not out_dir.is_dir():
        raise FileNotFoundError(f"the output's directory {str(out_dir)!r} does not exist")
    if Path(output_path).resolve() == Path(input_path).resolve():
        raise ValueError("the output file must not be the input file")
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")

    observability = ObservabilityConfig(served_model_name=served_model_name,
                                        enable_metrics=False, log_stats_interval=0)
    engine = AsyncLLMEngine.from_engine_args(engine_args, observability)
    bound = max_in_flight or IN_FLIGHT_PER_SEQ * engine.max_num_seqs
    show = sys.stderr.isatty() if progress is None else progress
    suffix = uuid.uuid4().hex[:24]
    target = Path(output_path).resolve()
    tmp = target.with_name(f".{target.name}.{suffix}.part")  # replaces OUT once complete
    try:
        with open(tmp, "x", encoding="utf-8") as out:
            summary = asyncio.run(_run(engine, lines, out, suffix, served_model_name,
                                       tool_call_parser, bound, show))
        os.replace(tmp, target)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, KeyboardInterrupt):
            print("run-batch: interrupted; no output was written", file=sys.stderr)
            return 130
        raise
    print(f"run-batch: {summary}; wrote {output_path}", flush=True)
    if summary_json:
        Path(summary_json).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    if engine.dead_error:
        print(f"run-batch: the engine stopped: {engine.dead_error}", file=sys.stderr)
        return 1
    return 0


async def _run(engine, lines: list[BatchLine], out, suffix: str, served_model_name: str,
               tool_call_parser: str, bound: int, progress: bool) -> BatchSummary:
    """Run the lines and write their output lines to ``out`` in input order."""
    from tqdm.auto import tqdm

    # nothing is ever refused as busy (all lines are known up front) and the lines
    # were read from a local file, so there is no body limit
    ctx = ServerContext(engine, served_model_name, max_waiting=sys.maxsize,
                        max_body_bytes=sys.maxsize,
                        tool_parser=TOOL_PARSERS[tool_call_parser]())
    execute = make_executor(ctx, {"/v1/completions": create_completion,
                                  "/v1/chat/completions": create_chat_completion})
    summary = BatchSummary(lines=len(lines))
    done: dict[int, dict] = {}  # finished out of order, waiting for the earlier ones
    next_out = 0
    bar = tqdm(total=len(lines), desc="Running batch", unit="line", dynamic_ncols=True,
               disable=not progress)
    start = time.monotonic()

    async def run_line(item: BatchLine) -> tuple[int, str, object]:
        try:
            return await execute(item.endpoint, item.line.body)
        except Exception:  # the line fails (a 500, as on the server)
            logger.exception("line %d (custom_id %r) failed", item.line.line,
                             item.line.custom_id)
            return 500, "", internal_error().body()

    def finish(index: int, item: BatchLine, status: int, request_id: str, body) -> None:
        nonlocal next_out
        ok = 200 <= status < 300
        summary.ok += ok
        summary.failed += not ok
        if ok and isinstance(body, dict):
            summary.output_tokens += (body.get("usage") or {}).get("completion_tokens", 0)
        done[index] = output_line(f"batch_req_{suffix}_{item.line.line}", item.line.custom_id,
                                  status, request_id, body)
        while next_out in done:
            out.write(json.dumps(done.pop(next_out)) + "\n")
            next_out += 1
        bar.update(1)
        elapsed = time.monotonic() - start
        if elapsed > 0:
            bar.set_postfix_str(f"{summary.output_tokens / elapsed:.1f} tok/s, "
                                f"{summary.failed} failed", refresh=False)

    queue = iter(enumerate(lines))

    async def worker() -> None:
        for index, item in queue:  # shared: each line is taken by one worker
            finish(index, item, *await run_line(item))

    engine.start(hold=True)  # the first step sees the first lines all at once, as
    workers = min(bound, len(lines))  # LLM.generate's does
    running = asyncio.gather(*(worker() for _ in range(workers)))
    queued, still = 0, 0
    while queued < workers and still < 4 and not running.done():  # until adds stop coming
        await asyncio.sleep(0.005)
        now_queued = engine.num_waiting
        still = still + 1 if now_queued == queued else 0
        queued = now_queued
    engine.release()
    try:
        await running
    finally:
        bar.close()
        await engine.shutdown()
    summary.seconds = time.monotonic() - start
    return summary


def add_run_batch_args(p: argparse.ArgumentParser) -> None:
    """The ``run-batch`` flags besides the engine's."""
    p.add_argument("-i", "--input-file", required=True,
                   help="Batch API input file (JSONL): one {custom_id, method, url, body} "
                        "a line, url /v1/completions or /v1/chat/completions")
    p.add_argument("-o", "--output-file", required=True,
                   help="where to write the output (JSONL): one line per input line, in "
                        "input order, each with its response status and body")
    p.add_argument("model", nargs="?", default=None,
                   help="model directory in Hugging Face layout (default: the embedded model)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id the lines' 'model' must name (default: the model "
                        "directory's name, as kvserve serve)")
    p.add_argument("--tool-call-parser", default="hermes", choices=TOOL_PARSERS.names(),
                   help="how the model writes tool calls (default: hermes)")
    p.add_argument("--max-lines-in-flight", type=int, default=None,
                   help="lines running at once (default: 4 x max_num_seqs)")
    p.add_argument("--summary-json", default=None,
                   help="also write the run's summary (lines, ok, failed, seconds without "
                        "the model load, output tokens) to this JSON file")


def run_batch_from_args(args: argparse.Namespace) -> int:
    """``kvserve run-batch``."""
    return run_batch(args.input_file, args.output_file, EngineArgs.from_cli_args(args),
                     served_name(args), tool_call_parser=args.tool_call_parser,
                     max_in_flight=args.max_lines_in_flight,
                     summary_json=args.summary_json)

"""The OpenAI-compatible HTTP server: ``build_app(...)`` (FastAPI) and ``run_server(args)``.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
POST /v1/embeddings, GET /v1/models,
GET /v1/models/{id}, POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, GET /health, GET /version, GET /metrics (Prometheus),
GET /v1/stats (the live window, JSON), GET /dashboard (a page that reads it),
POST /tokenize, POST /detokenize. Every error is OpenAI's ``{"error": {...}}`` body; a client mistake
is a 4xx, an internal failure a 500 for that request only.

SIGTERM / SIGINT: uvicorn stops accepting connections and lets in-flight responses
finish; shortly before ``--shutdown-timeout`` the requests still running are aborted
(streams end with an error event and ``[DONE]``, others get a 503); the engine thread
then stops and the process exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import wraps
from pathlib import Path

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from kvserve import __version__
from kvserve.config import ObservabilityConfig
from kvserve.default_model import default_model_dir
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.engine_args import EngineArgs
from kvserve.entrypoints.openai.graceful import GracefulServer
from kvserve.entrypoints.openai.errors import (APIError, bad_request, http_status_error,
                                               internal_error)
from kvserve.entrypoints.openai.protocol import (DetokenizeRequest, ModelCard, ModelList,
                                                 TokenizeRequest)
from kvserve.entrypoints.openai.serving_chat import create_chat_completion, render_chat
from kvserve.entrypoints.openai.serving_completions import create_completion
from kvserve.entrypoints.openai.context import ServerContext
from kvserve.entrypoints.openai.lora_routes import LoRAModels, add_lora_routes, \
    parse_lora_modules
from kvserve.entrypoints.openai.openapi import build_openapi
from kvserve.entrypoints.openai.request_body import parse_request
from kvserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from kvserve.entrypoints.openai.serving_embeddings import create_embedding
from kvserve.entrypoints.openai.serving_responses import create_response
from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kvserve.model.tokenizer import load_chat_template
from kvserve.batch.runner import BatchRunner
from kvserve.batch.store import BatchStore
from kvserve.entrypoints.openai.batch_routes import add_batch_routes, make_executor
from kvserve.logger import init_logger


@dataclass(frozen=True)
class BatchSettings:
    state_dir: str
    max_lines_in_flight: int | None = None  # None: 2 x max_num_seqs
    max_file_bytes: int = 200 * 2**20


def default_state_dir() -> str:
    """``$XDG_CACHE_HOME/kvserve/state`` (``~/.cache/kvserve/state``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "kvserve", "state")


def dashboard_page() -> str:
    """The live dashboard: one self-contained HTML file shipped in the package."""
    from importlib.resources import files
    return files("kvserve.entrypoints.dashboard").joinpath("dashboard.html").read_text()

logger = init_logger(__name__)

DEFAULT_MAX_WAITING = 1024
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_MODEL_NAME = "kvserve-default"
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    """Pure ASGI (no body buffering, streaming untouched): Bearer key on /v1 and tokenize."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):  # constant time
                msg = ("Incorrect API key provided." if token else
                       "Missing API key: send it as 'Authorization: Bearer <key>'.")
                await APIError(msg, 401, code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _endpoint(fn):
    """Turn APIErrors into OpenAI bodies and any other exception into a logged 500."""
    @wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except APIError as e:
            return e.response()
        except Exception:  # noqa: BLE001 - one failed request, not a dead server
            logger.exception("%s %s failed", request.method, request.url.path)
            return internal_error().response()
    return wrapper


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None,
              max_waiting: int = DEFAULT_MAX_WAITING,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              tool_call_parser: str = "hermes", batch: BatchSettings | None = None,
              reasoning_parser: str | None = None, chat_template: str | None = None,
              auto_tool_choice: bool = True,
              lora_modules: list[tuple[str, str]] = ()) -> FastAPI:
    """``batch``: where the Batch API keeps its state (None: no /v1/files, /v1/batches);
    ``lora_modules``: (name, directory) of the LoRA adapters served from the start."""
    ctx = ServerContext(engine, served_model_name, max_waiting, max_body_bytes,
                        TOOL_PARSERS[tool_call_parser](),
                        None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser](),
                        chat_template, auto_tool_choice)
    tok = engine.tokenizer
    vocab = max(tok.vocab_size, engine.vocab_size)
    loras = LoRAModels(ctx, engine)

    runner = None
    if batch is not None:
        store = BatchStore(batch.state_dir)
        execute = make_executor(ctx, {"/v1/completions": create_completion,
                                      "/v1/chat/completions": create_chat_completion})
        runner = BatchRunner(store, execute, lambda: engine.num_in_flight - runner.in_flight,
                             batch.max_lines_in_flight or 2 * engine.max_num_seqs,
                             engine.max_num_seqs, engine.metrics)
        if engine.live is not None:
            engine.live.batch_counts = runner.counts

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        for name, path in lora_modules:  # a bad one stops the server before it serves
            await loras.load(name, path)
        task = asyncio.get_running_loop().create_task(runner.run()) if runner else None
        yield
        if task is not None:
            task.cancel()
        await engine.shutdown()
        if runner is not None:
            runner.store.close()

    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    document = build_openapi(__version__, protected=bool(api_key))
    app.openapi = lambda: document
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        response = http_status_error(exc.status_code, None if exc.status_code in (404, 405)
                                     else str(exc.detail)).response()
        if exc.headers:  # a 405's Allow (RFC 9110: name the methods the route has)
            response.headers.update(exc.headers)
        return response
    app.add_exception_handler(StarletteHTTPException, on_http_error)

    def route(path: str, method: str):
        def register(fn):
            app.add_route(path, _endpoint(fn), methods=[method], include_in_schema=False)
            return fn
        return register

    def model_card() -> ModelCard:
        return ModelCard(id=served_model_name, max_model_len=engine.max_model_len,
                         default_sampling_params=engine.sampling_defaults)

    @route("/health", "GET")
    async def health(request: Request) -> Response:
        if not engine.is_running:
            raise APIError(engine.dead_error or "the engine is not running", 503)
        kernels = engine.kernel_build
        return JSONResponse({"status": "ok", "native_kernels": {
            "compiled": kernels.compiled, "reason": kernels.reason}})

    @route("/version", "GET")
    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    @route("/metrics", "GET")
    async def metrics(request: Request) -> Response:
        if engine.metrics is None:
            raise APIError("metrics are disabled", 404)
        engine.metrics.engine_healthy.set(1 if engine.is_running else 0)
        body, ctype = engine.metrics.render()
        return Response(body, media_type=ctype)

    @route("/v1/stats", "GET")
    async def stats(request: Request) -> Response:
        if engine.live is None:
            raise APIError("metrics are disabled", 404)
        return JSONResponse(engine.live.view(engine.is_running))

    @route("/dashboard", "GET")
    async def dashboard(request: Request) -> Response:
        return HTMLResponse(dashboard_page())

    @route("/v1/models", "GET")
    async def list_models(request: Request) -> Response:
        cards = [model_card(), *loras.cards(engine.max_model_len)]
        return Response(ModelList(data=cards).model_dump_json(),
                        media_type="application/json")

    @route("/v1/models/{model:path}", "GET")
    async def get_model(request: Request) -> Response:
        name = request.path_params["model"]
        ctx.check_model(name)
        card = next((c for c in loras.cards(engine.max_model_len) if c.id == name),
                    model_card())
        return Response(card.model_dump_json(), media_type="application/json")

    @route("/v1/completions", "POST")
    async def completions(request: Request) -> Response:
        return await create_completion(request, ctx)

    @route("/v1/chat/completions", "POST")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, ctx)

    @route("/v1/responses", "POST")
    async def responses(request: Request) -> Response:
        return await create_response(request, ctx)

    @route("/v1/embeddings", "POST")
    async def embeddings(request: Request) -> Response:
        return await create_embedding(request, ctx)

    @route("/tokenize", "POST")
    async def tokenize(request: Request) -> Response:
        req = await parse_request(request, TokenizeRequest, max_body_bytes)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'")
        if req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            _, ids = await render_chat(ctx, req.messages, req.add_generation_prompt)
        strs = [tok.id_to_token(t) for t in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @route("/detokenize", "POST")
    async def detokenize(request: Request) -> Response:
        req = await parse_request(request, DetokenizeRequest, max_body_bytes)
        ctx.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return JSONResponse({"prompt": tok.decode(req.tokens)})

    add_lora_routes(route, loras, max_body_bytes)
    if runner is not None:
        add_batch_routes(route, runner.store, runner, batch.max_file_bytes, max_body_bytes)
    return app


def served_name(args: argparse.Namespace) -> str:
    if getattr(args, "served_model_name", None):
        return args.served_model_name
    model = getattr(args, "model", None)
    if model is None or Path(model).resolve() == Path(default_model_dir()).resolve():
        return DEFAULT_MODEL_NAME
    return Path(model).resolve().name


def _check_server_args(args: argparse.Namespace) -> None:
    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", None):
        raise ValueError("--lora-modules serves LoRA adapters: it needs --enable-lora")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("max_waiting", "max_body_bytes", "max_batch_lines_in_flight",
                 "max_batch_file_bytes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("log_stats_interval", "shutdown_timeout"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")


DEAD_ENGINE_EXIT_S = 2.0  # a dead engine's server answers 503 this long, then exits 1


def usage_hint(host: str, port: int, name: str, api_key: bool) -> str:
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    auth = ' -H "Authorization: Bearer $KVSERVE_API_KEY"' if api_key else ""
    return (f"kvserve is serving '{name}' at {base}/v1 (OpenAI-compatible). Try:\n"
            f"  curl {base}/v1/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{{\"model\": \"{name}\", \"prompt\": \"def fibonacci(n):\", "
            f"\"max_tokens\": 32, \"temperature\": 0}}'\n"
            f"  or: OpenAI(base_url=\"{base}/v1\", api_key=\"...\")  "
            f"(metrics: {base}/metrics)")


def slow_paths_warning(reason: str) -> str:
    """What ``kvserve serve`` says at start when the native kernels did not build."""
    return (f"native kernels not built ({reason}): kvserve serves on its slower torch "
            f"paths. Install a C compiler with OpenMP (gcc, or set CC) for the fast ones; "
            f"/health and the kernels_compiled metric report it.")


@dataclass(frozen=True)
class ServerSettings:
    """What ``kvserve serve``'s flags say, checked: the engine's arguments, what it
    records, the app's settings (``build_app``'s keywords but the key) and the key."""

    engine_args: EngineArgs
    observability: ObservabilityConfig
    app: dict
    name: str
    api_key: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerSettings":
        _check_server_args(args)
        name = served_name(args)
        observability = ObservabilityConfig(
            served_model_name=name, metrics_prefix=args.metrics_prefix,
            log_stats_interval=args.log_stats_interval,
            otlp_traces_endpoint=args.otlp_traces_endpoint)
        app = dict(served_model_name=name, max_waiting=args.max_waiting,
                   max_body_bytes=args.max_body_bytes,
                   tool_call_parser=getattr(args, "tool_call_parser", "hermes"),
                   reasoning_parser=getattr(args, "reasoning_parser", None),
                   chat_template=(load_chat_template(args.chat_template)
                                  if getattr(args, "chat_template", None) else None),
                   auto_tool_choice=getattr(args, "enable_auto_tool_choice", True),
                   lora_modules=parse_lora_modules(getattr(args, "lora_modules", None)),
                   batch=BatchSettings(args.state_dir or default_state_dir(),
                                       args.max_batch_lines_in_flight,
                                       args.max_batch_file_bytes))
        return cls(EngineArgs.from_cli_args(args), observability, app, name,
                   args.api_key or os.environ.get("KVSERVE_API_KEY") or None)


def run_server(args: argparse.Namespace) -> int:
    """``kvserve serve``: load the model, then serve until SIGTERM / SIGINT (exit 0)."""
    settings = ServerSettings.from_args(args)
    hint = usage_hint(args.host, args.port, settings.name, bool(settings.api_key))
    engine = AsyncLLMEngine.from_engine_args(settings.engine_args, settings.observability)
    if not engine.kernel_build.compiled:
        logger.warning(slow_paths_warning(engine.kernel_build.reason))
    app = build_app(engine, api_key=settings.api_key, **settings.app)

    def abort_in_flight() -> None:  # the graceful stop's deadline is near
        if engine.num_in_flight:
            logger.info("aborting %d in-flight requests before the shutdown timeout",
                        engine.num_in_flight)
            engine.abort_all("the server is shutting down")

    server = GracefulServer(app, args, hint, abort_in_flight)

    def exit_dead_engine() -> None:  # /health answers 503 meanwhile, then the server exits
        logger.error("%s: the server exits", engine.dead_error)
        asyncio.get_running_loop().call_later(DEAD_ENGINE_EXIT_S, setattr, server,
                                              "should_exit", True)
    engine.on_dead = exit_dead_engine
    server.run()
    if engine.dead_error is not None:
        return 1
    return 0 if server.started else 1

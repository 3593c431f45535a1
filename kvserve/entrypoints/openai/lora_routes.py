"""LoRA adapters over HTTP, as vLLM serves them: ``--lora-modules`` at start, and
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter at run time (behind the API
key, like every /v1 route). A request's ``model`` names the adapter it runs with;
GET /v1/models lists each adapter with the base model as its ``parent``."""
from __future__ import annotations

import asyncio
import itertools
import json

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.entrypoints.openai.context import ServerContext
from kvserve.entrypoints.openai.errors import APIError, bad_request
from kvserve.entrypoints.openai.protocol import (LoadLoRAAdapterRequest, ModelCard,
                                                 UnloadLoRAAdapterRequest)
from kvserve.entrypoints.openai.request_body import parse_request
from kvserve.logger import init_logger
from kvserve.lora.request import LoRARequest

logger = init_logger(__name__)


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules`` items: ``name=path``, or vLLM's JSON form ``{"name": ..,
    "path": .., "base_model_name": ..}``; (name, path) each, names unique."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON: {e}") from None
            unknown = set(item) - {"name", "path", "base_model_name"}
            if unknown or not isinstance(item.get("name"), str) or not isinstance(
                    item.get("path"), str):
                raise ValueError(f"--lora-modules {value!r}: give 'name' and 'path' (and "
                                 "optionally 'base_model_name'), nothing else")
            name, path = item["name"], item["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path (or JSON)")
        if any(name == n for n, _ in modules):
            raise ValueError(f"--lora-modules names adapter {name!r} twice")
        modules.append((name, path))
    return modules


class LoRAModels:
    """The adapters the server names, kept in ``ctx.loras`` (what requests read)."""

    def __init__(self, ctx: ServerContext, engine: AsyncLLMEngine) -> None:
        self.ctx = ctx
        self.engine = engine
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def load(self, name: str, path: str) -> LoRARequest:
        """Check the adapter against the base model and serve it; ValueError says why not."""
        async with self._lock:
            if name == self.ctx.model_name or name in self.ctx.loras:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            lora = LoRARequest(name, next(self._ids), path, self.ctx.model_name)
            await self.engine.add_lora(lora)
            self.ctx.loras[name] = lora
            logger.info("LoRA adapter %r served from %s", name, path)
            return lora

    async def unload(self, name: str, lora_int_id: int | None) -> None:
        async with self._lock:
            lora = self.ctx.loras.get(name)
            if lora is None or (lora_int_id is not None and lora_int_id != lora.lora_int_id):
                raise APIError(f"The lora adapter '{name}' cannot be found.", 404,
                               param="lora_name", code="model_not_found")
            del self.ctx.loras[name]  # new requests may no longer name it
            await self.engine.remove_lora(lora.lora_int_id)
            logger.info("LoRA adapter %r no longer served", name)

    def cards(self, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=name, root=lora.lora_path, parent=self.ctx.model_name,
                          max_model_len=max_model_len)
                for name, lora in self.ctx.loras.items()]


def add_lora_routes(route, models: LoRAModels, max_body_bytes: int) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (``route(path, method)``
    registers a handler as the app's own routes are)."""

    @route("/v1/load_lora_adapter", "POST")
    async def load_lora_adapter(request: Request) -> Response:
        req = await parse_request(request, LoadLoRAAdapterRequest, max_body_bytes)
        try:
            await models.load(req.lora_name, req.lora_path)
        except ValueError as e:
            raise bad_request(str(e), "lora_name" if "already" in str(e) else "lora_path") \
                from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added "
                                 "successfully.")

    @route("/v1/unload_lora_adapter", "POST")
    async def unload_lora_adapter(request: Request) -> Response:
        req = await parse_request(request, UnloadLoRAAdapterRequest, max_body_bytes)
        await models.unload(req.lora_name, req.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed "
                                 "successfully.")

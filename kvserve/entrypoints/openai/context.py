"""ServerContext: what every handler needs — the engine and the server's settings."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.entrypoints.openai.errors import APIError


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ServerContext:
    """What every handler needs: the engine and the server's settings."""

    engine: AsyncLLMEngine
    model_name: str
    max_waiting: int
    max_body_bytes: int
    tool_parser: Any = None  # a tool_parsers.ToolParser
    reasoning_parser: Any = None  # a reasoning_parsers.ReasoningParser, or None: off
    chat_template: str | None = None  # --chat-template: instead of the model's
    auto_tool_choice: bool = True  # --enable-auto-tool-choice

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist. This server serves "
                           f"`{self.model_name}` (see GET /v1/models).", 404, param="model",
                           code="model_not_found")

    def check_capacity(self, num_new: int) -> None:
        if not self.engine.is_running:
            raise APIError("the server is shutting down or its engine stopped", 503)
        waiting = self.engine.num_waiting
        if waiting + num_new > self.max_waiting:
            raise APIError(f"the server is busy: {waiting} requests are waiting (limit "
                           f"{self.max_waiting}); retry later", 429,
                           code="rate_limit_exceeded")

"""ServerContext: what every handler needs — the engine and the server's settings."""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.entrypoints.openai.errors import APIError
from kvserve.lora.request import LoRARequest


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
    # the LoRA adapters served, by name (one dict, shared by every request's context)
    loras: dict[str, LoRARequest] = field(default_factory=dict)
    lora: LoRARequest | None = None  # a request's context: the adapter its model names

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.loras:
            served = ", ".join(f"`{m}`" for m in [self.model_name, *self.loras])
            raise APIError(f"The model `{model}` does not exist. This server serves "
                           f"{served} (see GET /v1/models).", 404, param="model",
                           code="model_not_found")

    def for_model(self, model: str | None) -> ServerContext:
        """The context of a request naming ``model``: the base model's (this one), or a
        LoRA adapter's, whose responses name the adapter; 404 for any other name."""
        self.check_model(model)
        lora = self.loras.get(model) if model is not None else None
        return self if lora is None else dataclasses.replace(self, model_name=model, lora=lora)

    def check_capacity(self, num_new: int) -> None:
        if not self.engine.is_running:
            raise APIError("the server is shutting down or its engine stopped", 503)
        waiting = self.engine.num_waiting
        if waiting + num_new > self.max_waiting:
            raise APIError(f"the server is busy: {waiting} requests are waiting (limit "
                           f"{self.max_waiting}); retry later", 429,
                           code="rate_limit_exceeded")

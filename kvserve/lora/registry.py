"""The engine's adapters: each checked once against the base model when added, by
name and id, so a request names one that will load."""
from __future__ import annotations

import torch

from kvserve.config.lora import LoRAConfig
from kvserve.lora.adapter import load_adapter
from kvserve.lora.request import LoRARequest
from kvserve.model.config import ArchConfig
from kvserve.model.registry import MODELS


class LoRARegistry:
    def __init__(self, config: LoRAConfig | None, arch: ArchConfig) -> None:
        self.config = config
        self.arch = arch
        self.by_id: dict[int, LoRARequest] = {}
        self._shape_model = None  # the base model on the meta device: names and shapes

    def check(self, request: LoRARequest) -> None:
        """Raise ValueError unless ``request`` can run: adapters on, the id and the name
        unused by another adapter, the files an adapter of this base model."""
        if self.config is None:
            raise ValueError("LoRA adapters are not enabled: start the engine with "
                             "enable_lora (--enable-lora)")
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(request).__name__}")
        known = self.by_id.get(request.lora_int_id)
        if known == request:
            return
        if known is not None:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter "
                             f"{known.lora_name!r} ({known.lora_path})")
        if any(r.lora_name == request.lora_name for r in self.by_id.values()):
            raise ValueError(f"an adapter named {request.lora_name!r} is already loaded")
        if self._shape_model is None:
            with torch.device("meta"):
                self._shape_model = MODELS[self.arch.architecture](self.arch)
        load_adapter(request.lora_name, request.lora_path, self._shape_model,
                     self.config.max_lora_rank, torch.float32)

    def add(self, request: LoRARequest) -> bool:
        """Check and remember ``request``; False if it was known already."""
        self.check(request)
        if request.lora_int_id in self.by_id:
            return False
        self.by_id[request.lora_int_id] = request
        return True

    def remove(self, lora_int_id: int) -> LoRARequest | None:
        return self.by_id.pop(lora_int_id, None)

    def by_name(self, name: str) -> LoRARequest | None:
        return next((r for r in self.by_id.values() if r.lora_name == name), None)

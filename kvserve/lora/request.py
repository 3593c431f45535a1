"""Which adapter a request runs with."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter, as vLLM's: ``lora_name`` (what the API's ``model`` field says),
    ``lora_int_id`` (a positive id unique among the adapters in use) and ``lora_path``
    (a PEFT adapter directory)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def prefix_key(self) -> int:
        """The root of this adapter's prefix-cache hashes: the same for every process
        that serves this adapter from this path, different from every other adapter's
        (and from the base model's, whose root is None), so no request reads KV that
        another adapter computed."""
        digest = hashlib.sha256(f"{self.lora_name}\0{self.lora_path}".encode()).digest()
        return int.from_bytes(digest[:8], "little")

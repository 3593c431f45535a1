"""LoRA adapters served beside their base model (as vLLM's ``--enable-lora``).

- ``request.py``: :class:`LoRARequest`, which adapter a request runs with;
- ``adapter.py``: a PEFT adapter directory read onto the engine's fused layers;
- ``layers.py``: the adapter slots of one linear layer and their low-rank products;
- ``manager.py``: the worker's slots and cache of adapters, and each step's rows.

The base GEMM of a step runs once for every row; each row whose request names an
adapter then gets that adapter's ``B @ (A @ x)`` added, rows grouped by slot.
"""
from kvserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]

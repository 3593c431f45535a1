"""The worker's adapters: slots in every adapted layer, a cache of adapters read, and
the slot each row of a step reads.

The scheduler lets at most ``max_loras`` adapters run in one step; the worker keeps
that many slots. A step's adapters that no slot holds take the slots whose adapters
were used longest ago (from the cache of ``max_cpu_loras`` adapters read from disk,
least recently used read again first). Weights are copied into a slot at most once
per change of adapter, never per step.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from torch import nn

from kvserve.config.lora import LoRAConfig
from kvserve.logger import init_logger
from kvserve.lora.adapter import LoRAAdapter, load_adapter, lora_layers
from kvserve.lora.layers import LoRALayer, LoRARows
from kvserve.lora.request import LoRARequest

if TYPE_CHECKING:
    from kvserve.core.scheduler_output import ScheduledRequest

logger = init_logger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype,
                 kernels=None, device: torch.device = torch.device("cpu")) -> None:
        self.model = model
        self.config = config
        self.dtype = dtype
        self.rows = LoRARows(device)
        self.layers: dict[str, LoRALayer] = {}
        for name, sizes in lora_layers(model).items():
            linear = model.get_submodule(name)
            layer = LoRALayer(linear.in_features, sizes, config.max_loras,
                              config.max_lora_rank, dtype, self.rows, kernels, device)
            linear.lora = layer
            self.layers[name] = layer
        self.slot_held: list[LoRARequest | None] = [None] * config.max_loras
        self._last_used = [0.0] * config.max_loras
        self.adapters: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()  # LRU first
        self.loads = 0  # adapters read from disk (tests and logs)

    @property
    def slot_bytes(self) -> int:
        """The bytes of every slot of every adapted layer."""
        return sum(layer.nbytes for layer in self.layers.values())

    @property
    def reserved_bytes(self) -> int:
        """What adapters may take: the slots, and the cache at the largest rank."""
        per_adapter = self.slot_bytes // self.config.max_loras
        return self.slot_bytes + self.config.cache_size * per_adapter

    def begin_step(self, order: Sequence[ScheduledRequest]) -> bool:
        """Slots for the adapters of the step's requests (flat rows in ``order``), and
        each row's slot; returns whether any row runs an adapter."""
        wanted = list(dict.fromkeys(s.lora for s in order if s.lora is not None))
        if not wanted:
            self.rows.set(None)
            return False
        slot_of = self._activate(wanted)
        self.rows.set(np.repeat(
            np.array([slot_of[s.lora] if s.lora is not None else -1 for s in order],
                     dtype=np.int64),
            [len(s.token_ids) for s in order]))
        return True

    def end_step(self) -> None:
        self.rows.set(None)

    def _activate(self, wanted: list[LoRARequest]) -> dict[LoRARequest, int]:
        if len(wanted) > len(self.slot_held):
            raise RuntimeError(f"a step runs {len(wanted)} adapters but the worker has "
                               f"{len(self.slot_held)} slots (max_loras): the scheduler "
                               "must not schedule more")
        now = time.monotonic()
        slot_of = {r: self.slot_held.index(r) for r in wanted if r in self.slot_held}
        for request in wanted:
            if request in slot_of:
                continue
            free = [s for s, held in enumerate(self.slot_held) if held not in wanted]
            slot = min(free, key=lambda s: (self.slot_held[s] is not None, self._last_used[s]))
            adapter = self._adapter(request)
            for name, layer in self.layers.items():
                layer.load(slot, adapter.layers.get(name))
            self.slot_held[slot] = request
            slot_of[request] = slot
        for slot in slot_of.values():
            self._last_used[slot] = now
        return slot_of

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.adapters.get(request)
        if adapter is not None:
            self.adapters.move_to_end(request)
            return adapter
        start = time.perf_counter()
        adapter = load_adapter(request.lora_name, request.lora_path, self.model,
                               self.config.max_lora_rank, self.dtype)
        self.loads += 1
        logger.info("LoRA adapter %r (rank %d, %d layers) read from %s in %.2fs",
                    request.lora_name, adapter.rank, len(adapter.layers), request.lora_path,
                    time.perf_counter() - start)
        self.adapters[request] = adapter
        while len(self.adapters) > self.config.cache_size:
            self.adapters.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (unloaded): its cached weights and its slot."""
        for request in [r for r in self.adapters if r.lora_int_id == lora_int_id]:
            del self.adapters[request]
        for slot, held in enumerate(self.slot_held):
            if held is not None and held.lora_int_id == lora_int_id:
                for layer in self.layers.values():
                    layer.load(slot, None)
                self.slot_held[slot] = None

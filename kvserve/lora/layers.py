"""The adapter slots of one linear layer, and which slot each row of a step reads.

A layer keeps ``num_slots`` adapters at once, each padded to ``max_rank`` per output
slice, stacked so that one native call serves every row of a step:

- ``a[s]``: [slices * max_rank, in], slice i's A in rows ``i*max_rank`` onwards;
- ``b[s]``: [slices * max_rank, out], slice i's B (transposed, scaled) in the same
  rows, under that slice's output columns only (zero elsewhere); rows padded a little
  past ``out`` (see ``kernels/lora.c``).

For the rows ``idx`` of slot s, the layer's output gains ``(x[idx] @ a[s].T) @ b[s]``:
per slice exactly PEFT's ``B(A(x)) * scaling``. The native kernel skips the padding
(it reads each slot's rank); torch's path multiplies it, zeros and all.
"""
from __future__ import annotations

import numpy as np
import torch

from kvserve.lora.adapter import AdaptedLayer


B_ROW_PAD = 16  # floats


class LoRARows:
    """The slot of each row of the running step (-1: the base model alone), shared by
    every adapted layer of a model. ``offset``: where the rows a layer is given start
    (a large MLP runs its rows in chunks, see ``layers.in_row_chunks``)."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device
        self.slots: torch.Tensor | None = None  # int64 [rows]; None: no adapter this step
        self._host: np.ndarray | None = None  # the same on the host
        self.offset = 0
        self._groups: dict[tuple[int, int], list[tuple[int, slice | torch.Tensor]]] = {}

    def set(self, slots: np.ndarray | None) -> None:
        self._groups = {}
        self.offset = 0
        self._host = None if slots is None else np.ascontiguousarray(slots, dtype=np.int64)
        self.slots = (None if self._host is None or not (self._host >= 0).any()
                      else torch.from_numpy(self._host).to(self.device))

    def window(self, rows: int) -> torch.Tensor:
        """The slots of the ``rows`` rows a layer is given now."""
        if self.offset + rows > self.slots.shape[0]:
            raise RuntimeError(f"a layer got rows {self.offset}..{self.offset + rows} of a "
                               f"step of {self.slots.shape[0]} rows: adapted layers must see "
                               "every row of the step (no out_rows)")
        return self.slots[self.offset:self.offset + rows]

    def groups(self, rows: int) -> list[tuple[int, slice | torch.Tensor]]:
        """(slot, its rows: a slice where they are contiguous, else an index tensor) for
        each slot among the ``rows`` rows a layer is given now."""
        key = (self.offset, rows)
        if key not in self._groups:
            self.window(rows)  # checks the range
            slots = self._host[self.offset:self.offset + rows]
            found = []
            for s in np.unique(slots):
                if s < 0:
                    continue
                idx = np.flatnonzero(slots == s)
                if idx[-1] - idx[0] + 1 == len(idx):
                    found.append((int(s), slice(int(idx[0]), int(idx[-1]) + 1)))
                else:
                    found.append((int(s), torch.from_numpy(idx).to(self.device)))
            self._groups[key] = found
        return self._groups[key]


class LoRALayer:
    """The adapter slots of one linear layer (see the module's docstring)."""

    def __init__(self, in_features: int, slice_sizes: list[int], num_slots: int,
                 max_rank: int, dtype: torch.dtype, rows: LoRARows, kernels=None,
                 device: torch.device = torch.device("cpu")) -> None:
        self.rows = rows
        self.max_rank = max_rank
        self.bounds = np.cumsum([0] + slice_sizes).tolist()
        width = len(slice_sizes) * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        # B's rows padded by a cache line: rows a power of two apart share cache sets
        padded = torch.zeros(num_slots, width, self.bounds[-1] + B_ROW_PAD, dtype=dtype,
                             device=device)
        self.b = padded[:, :, :self.bounds[-1]]
        self.ranks = torch.zeros(num_slots, dtype=torch.int64)
        self.kernels = kernels if dtype == torch.float32 and device.type == "cpu" else None
        self._bounds = torch.tensor(self.bounds, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        b_elements = self.b.shape[0] * self.b.stride(0)
        return (self.a.numel() + b_elements) * self.a.element_size()

    def load(self, slot: int, weights: AdaptedLayer | None) -> None:
        """Slot ``slot`` holds ``weights`` (None: nothing, the layer unadapted there)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        rank = 0
        for index, (a, b) in (weights.slices.items() if weights is not None else ()):
            r, first = a.shape[0], index * self.max_rank
            lo, hi = self.bounds[index], self.bounds[index + 1]
            self.a[slot, first:first + r] = a
            self.b[slot, first:first + r, lo:hi] = b.t()
            rank = max(rank, r)
        self.ranks[slot] = rank

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (the base layer's output for ``x``) plus each row's adapter product."""
        rows = x.shape[0]
        if self.kernels is not None and x.dtype == torch.float32 and out.is_contiguous():
            self.kernels.lora_rows(x.contiguous(), self.rows.window(rows), self.a, self.b,
                                   self.ranks, self.max_rank, self._bounds, out)
            return
        for slot, idx in self.rows.groups(rows):
            if isinstance(idx, slice):
                out[idx] += (x[idx] @ self.a[slot].t()) @ self.b[slot]
            else:
                out.index_add_(0, idx, (x.index_select(0, idx) @ self.a[slot].t()) @ self.b[slot])

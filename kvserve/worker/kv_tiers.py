"""Where KV blocks live outside the pool: host swap space and a memory-mapped file.

Both are a tensor of slots shaped [slots, layers, 2 (K/V), elements of a block's K (or V)
in the pool's layout]; the disk tier's tensor is backed by a file, so the OS pages it in
and out.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import torch

from kvserve.core.kv.tiers import OFFLOAD, ONLOAD, READS_POOL, SWAP_IN, SWAP_OUT, KVTransfer
from kvserve.model.attention import KVCache


def _slot_shape(caches: list[KVCache]) -> tuple[int, ...]:
    return (len(caches), 2, caches[0].k[0].numel())


class BlockStore:
    def __init__(self, num_slots: int, caches: list[KVCache], path: Path | None = None) -> None:
        shape = (num_slots, *_slot_shape(caches))
        dtype = caches[0].k.dtype
        if path is None:  # pinned beside a GPU's pool: its copies to and fro run at full speed
            self.data = torch.zeros(shape, dtype=dtype,
                                    pin_memory=caches[0].k.device.type == "cuda")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            numel = int(torch.Size(shape).numel())
            with open(path, "wb") as f:  # sparse file of the full size
                f.truncate(numel * torch.tensor([], dtype=dtype).element_size())
            self.data = torch.from_file(str(path), shared=True, size=numel,
                                        dtype=dtype).view(shape)
        self.path = path

    def close(self) -> None:
        if self.path is not None:
            del self.data
            try:
                os.unlink(self.path)
            except OSError:
                pass


def read_blocks(caches: list[KVCache], blocks: list[int]) -> torch.Tensor:
    idx = torch.tensor(blocks, device=caches[0].k.device)
    return torch.stack([torch.stack((c.k[idx].flatten(1), c.v[idx].flatten(1)), dim=1)
                        for c in caches], dim=1)


def write_blocks(caches: list[KVCache], blocks: list[int], data: torch.Tensor) -> None:
    idx = torch.tensor(blocks, device=caches[0].k.device)
    data = data.to(caches[0].k.device)
    for layer, c in enumerate(caches):
        c.k[idx] = data[:, layer, 0].view(-1, *c.k.shape[1:])
        c.v[idx] = data[:, layer, 1].view(-1, *c.v.shape[1:])


class TierMover:
    """Runs a step's transfers: every read first, then every write, so a block (or slot)
    that is both saved and reused in the same step is saved before it is overwritten."""

    def __init__(self, caches: list[KVCache], swap: BlockStore | None,
                 disk: BlockStore | None) -> None:
        self.caches = caches
        self.stores = {SWAP_OUT: swap, SWAP_IN: swap, OFFLOAD: disk, ONLOAD: disk}
        self.bytes_moved: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def run(self, transfers: list[KVTransfer]) -> None:
        start = time.perf_counter()
        by_kind: dict[str, list[KVTransfer]] = defaultdict(list)
        for t in transfers:
            by_kind[t.kind].append(t)
        staged = {}
        for kind, ts in by_kind.items():
            if kind in READS_POOL:
                staged[kind] = read_blocks(self.caches, [t.block for t in ts])
            else:
                staged[kind] = self.stores[kind].data[torch.tensor([t.slot for t in ts])]
        for kind, ts in by_kind.items():
            data = staged[kind]
            if kind in READS_POOL:
                self.stores[kind].data[torch.tensor([t.slot for t in ts])] = data.cpu()
            else:
                write_blocks(self.caches, [t.block for t in ts], data)
            self.bytes_moved[kind] += data.numel() * data.element_size()
        elapsed = time.perf_counter() - start
        total = sum(len(ts) for ts in by_kind.values())
        for kind, ts in by_kind.items():
            self.seconds[kind] += elapsed * len(ts) / total

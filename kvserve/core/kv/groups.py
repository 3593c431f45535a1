"""KV groups: how a model that mixes full-attention layers with sliding-window layers
(Gemma 2 and 3) shares one block pool, as vLLM's hybrid KV cache manager does.

Each block holds ``slots`` layers' KV. Group 0 is the full-attention layers; the
windowed layers are cut into groups of ``slots`` layers (of one window each). Every
group has its own block table over the same pool, so a windowed group can give back
the blocks that fell out of its window while the full group keeps the whole context.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]      # per group: 0 (full attention) or its window
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]   # per layer: which of a block's caches holds its KV
    slots: int                    # layers' KV per block

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_groups(layer_windows: tuple[int, ...], model_window: int | None) -> KVGroups | None:
    """The groups of a model whose layers have ``layer_windows`` (0: full attention);
    None when they are all alike (one table serves them) or the model windows every
    layer itself."""
    if model_window or not layer_windows or 0 not in layer_windows \
            or all(w == 0 for w in layer_windows):
        return None
    full = [i for i, w in enumerate(layer_windows) if w == 0]
    slots = len(full)
    windows, group, slot = [0], [0] * len(layer_windows), [0] * len(layer_windows)
    for s, layer in enumerate(full):
        slot[layer] = s
    by_window: dict[int, list[int]] = {}
    for layer, w in enumerate(layer_windows):
        if w:
            by_window.setdefault(w, []).append(layer)
    for w, layers in sorted(by_window.items()):
        for start in range(0, len(layers), slots):
            windows.append(w)
            for s, layer in enumerate(layers[start:start + slots]):
                group[layer], slot[layer] = len(windows) - 1, s
    return KVGroups(tuple(windows), tuple(group), tuple(slot), slots)


def engine_kv_groups(config) -> KVGroups | None:
    """The groups an engine config uses: paged memory only, unless turned off
    (``disable_hybrid_kv_cache_manager``) or a tier that keeps whole blocks is on."""
    cache, arch = config.cache, config.model.arch
    if (cache.kv_manager != "paged" or cache.disable_hybrid_kv_cache_manager
            or cache.kv_offload_dir or cache.warmup_prompts):
        return None
    return kv_groups(arch.layer_windows, arch.sliding_window)

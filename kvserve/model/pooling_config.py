"""A model's own pooling, as sentence-transformers saved it: ``modules.json`` names the
modules (a Normalize module means unit vectors), ``1_Pooling/config.json`` the pooling
mode (``pooling_mode_lasttoken``, ``_mean_tokens``, ``_cls_token``). A decoder without
them pools its last token and normalises, as vLLM does for causal models. Matryoshka
models (``matryoshka_dimensions`` or ``is_matryoshka`` in config.json) may be cut."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.pooling_params import PoolingParams

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str = "last"
    normalize: bool = True
    matryoshka: bool = False
    hidden_size: int = 0

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """``params`` with the model's defaults filled in; ValueError for what it cannot
        do."""
        if params.dimensions is not None:
            if not self.matryoshka:
                raise ValueError("dimensions: this model was not trained to be cut to fewer "
                                 "dimensions (no matryoshka_dimensions in its config)")
            if params.dimensions > self.hidden_size:
                raise ValueError(f"dimensions must be at most the model's "
                                 f"{self.hidden_size}, got {params.dimensions}")
        return PoolingParams(params.pooling or self.pooling,
                             self.normalize if params.normalize is None else params.normalize,
                             params.dimensions)


def read_pooling_config(model_dir: str | Path, hidden_size: int) -> PoolingConfig:
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    matryoshka = bool(cfg.get("matryoshka_dimensions") or cfg.get("is_matryoshka"))
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig(matryoshka=matryoshka, hidden_size=hidden_size)
    modules = json.loads(modules_file.read_text())
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    pooling = "last"
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            path = model_dir / m.get("path", "") / "config.json"
            mode = json.loads(path.read_text()) if path.is_file() else {}
            chosen = [name for key, name in _MODES.items() if mode.get(key)]
            others = [k for k, v in mode.items() if k.startswith("pooling_mode") and v
                      and k not in _MODES]
            if others or len(chosen) > 1:
                raise ValueError(f"{path}: pooling {others or chosen} is not supported; "
                                 f"supported: {', '.join(_MODES)} (one of them)")
            pooling = chosen[0] if chosen else "last"
    return PoolingConfig(pooling, normalize, matryoshka, hidden_size)

"""Which device the engine computes on: ``--device cpu|cuda|auto`` resolved against what
torch sees here."""
from __future__ import annotations

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(setting: str) -> str:
    """``auto``: cuda when torch sees a CUDA device, else cpu; ``cuda`` where torch sees
    none is an error that says why."""
    if setting == "auto":
        return "cuda" if cuda_available() else "cpu"
    if setting == "cuda" and not cuda_available():
        build = torch.version.cuda
        why = ("this torch build has no CUDA (a CPU wheel)" if build is None
               else f"torch {torch.__version__} (CUDA {build}) sees no CUDA device")
        raise ValueError(f"device 'cuda': {why}; use --device cpu or auto")
    return setting

"""ExecutionMode: how the layers run, chosen by the worker for its platform.

A layer that has more than one way to run defines ``configure(mode)`` and decides there
what the mode means for it (a float32 RMSNorm takes the native kernel, a GELU MLP keeps
torch's). :func:`configure_layers` is the one call that sets it, at start and again
when the worker changes its mind (the measured row padding), so what a layer does is
read in that layer's class alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ExecutionMode:
    kernels: Any = None            # kvserve.kernels.Kernels, or None: torch ops only
    packed_linear: bool = False    # linear layers on oneDNN with their weights packed once
    linear_min_rows: int = 1       # packed GEMMs of fewer rows run padded to this many



def configure_layers(model: nn.Module, mode: ExecutionMode) -> int:
    """Apply ``mode`` to every layer of ``model`` (itself included) that has a
    ``configure`` method; returns how many layers took it."""
    count = 0
    for module in model.modules():
        configure = getattr(module, "configure", None)
        if callable(configure):
            configure(mode)
            count += 1
    return count

"""StepProfiler: where a step's time goes — linear layers, attention, everything else.

One step in ``interval`` is timed (0: never). On that step forward hooks are put on
every linear layer and every attention block, and removed after it, so the other steps run with no
hooks at all. A module says which part it is with a class attribute ``step_part``
("linear" or "attention"). Time is exclusive: an attention block's own linear layers (qkv, o_proj)
count as linear, the rest of the block (rotary, KV writes, the attention kernel) as
attention. "other" is the rest of the worker's step: embedding, norms, activations,
input building, sampling. A captured step (worker/captured_step.py) has no modules to
hook: it times its own parts and reports them through :meth:`StepProfiler.add`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from torch import nn

PARTS = ("linear", "attention", "other")


@dataclass(frozen=True)
class StepTimeStats:
    """Cumulative seconds of the profiled steps, by part."""

    profiled_steps: int = 0
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)  # in PARTS order

    def by_part(self) -> dict[str, float]:
        return dict(zip(PARTS, self.seconds))


class StepProfiler:
    def __init__(self, model: nn.Module, interval: int) -> None:
        self.interval = interval
        self._modules = [(m, m.step_part) for m in model.modules()
                         if getattr(m, "step_part", None) in PARTS]
        self._countdown = interval
        self._stack: list[list] = []  # [part, start, time spent in nested modules]
        self._spent = {"linear": 0.0, "attention": 0.0}
        self._steps = 0
        self._totals = [0.0, 0.0, 0.0]
        self.active = False  # a profiled step is running

    def set_interval(self, interval: int) -> None:
        """Profile one step in ``interval`` from the next one on (0: none)."""
        self.interval = self._countdown = interval

    def due(self) -> bool:
        """Whether the coming step is profiled (counts steps)."""
        if self.interval <= 0:
            return False
        self._countdown -= 1
        if self._countdown > 0:
            return False
        self._countdown = self.interval
        return True

    def run(self, fn, *args):
        """``fn(*args)`` with its time split recorded."""
        handles = []
        for module, part in self._modules:
            handles.append(module.register_forward_pre_hook(self._enter(part)))
            handles.append(module.register_forward_hook(self._leave))
        self._spent = {"linear": 0.0, "attention": 0.0}
        self.active = True
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            total = time.perf_counter() - start
            self.active = False
            for h in handles:
                h.remove()
            self._stack.clear()
            lin, att = self._spent["linear"], self._spent["attention"]
            self._steps += 1
            for i, s in enumerate((lin, att, max(0.0, total - lin - att))):
                self._totals[i] += s

    def add(self, part: str, seconds: float) -> None:
        """Count ``seconds`` of the running profiled step as ``part`` (linear, attention)."""
        self._spent[part] += seconds

    def _enter(self, part: str):
        def hook(module, args):
            self._stack.append([part, time.perf_counter(), 0.0])
        return hook

    def _leave(self, module, args, output):
        part, start, nested = self._stack.pop()
        elapsed = time.perf_counter() - start
        self._spent[part] += elapsed - nested
        if self._stack:
            self._stack[-1][2] += elapsed
        return None

    def stats(self) -> StepTimeStats:
        return StepTimeStats(self._steps, tuple(self._totals))

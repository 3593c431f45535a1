"""The tuning guide's troubleshooting on the periodic stats line.

Each log interval is checked for the conditions ``kvserve tune`` also diagnoses; one
that holds for ``HOLD_INTERVALS`` intervals in a row is logged once, as a warning that
says what to change, and again only after it cleared.
"""
from __future__ import annotations

HOLD_INTERVALS = 3
STARVED_SHARE = 0.2


class IntervalDiagnostics:
    def __init__(self) -> None:
        self._preemptions = 0
        self._steps = self._starved = 0
        self._streak: dict[str, int] = {}

    def on_step(self, stats) -> None:
        self._steps += 1
        self._starved += stats.num_running > stats.num_scheduled_requests

    def end_interval(self, num_preemptions: int) -> list[str]:
        """The warnings due at the end of this interval."""
        preempted = num_preemptions - self._preemptions
        share = self._starved / self._steps if self._steps else 0.0
        held = {
            "kv": (preempted > 0, f"KV pool too small: requests were preempted in each of the "
                   f"last {HOLD_INTERVALS} intervals; give the KV cache more memory "
                   "(--kv-cache-memory) or lower --max-num-seqs"),
            "budget": (share > STARVED_SHARE, f"the step token budget starves decodes: "
                       f"{100 * share:.0f}% of steps left running requests out; raise "
                       "--max-num-batched-tokens"),
        }
        self._preemptions, self._steps, self._starved = num_preemptions, 0, 0
        due = []
        for key, (holds, message) in held.items():
            self._streak[key] = self._streak.get(key, 0) + 1 if holds else 0
            if self._streak[key] == HOLD_INTERVALS:
                due.append(message)
        return due

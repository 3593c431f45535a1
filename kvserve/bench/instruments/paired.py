"""The one statistic every bench reports for "A against B": the median of the per-round
ratios over rounds that ran A and B alternately, with the rounds' smallest and largest
ratio beside it (docs/statistics.md says why)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["PairedRatio", "paired_ratio", "summarize_ratios", "ratio_cell",
           "describe_ratio"]

Figure = Optional[float]  # a round's figure; None when that side of the round failed


@dataclass(frozen=True)
class PairedRatio:
    """A over B: the median, min and max of the ratios of the rounds both completed."""

    median: float
    min: float
    max: float
    rounds: int
    per_round: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.min, "max": self.max,
                "rounds": self.rounds, "per_round": list(self.per_round)}

    def describe(self) -> str:
        """``1.23x (median of 3 rounds' ratios; 1.18–1.31)``."""
        rounds = "1 round's ratio" if self.rounds == 1 else f"{self.rounds} rounds' ratios"
        return f"{self.median:.2f}x (median of {rounds}; {self.min:.2f}–{self.max:.2f})"

    def cell(self) -> str:
        """The short form for a table cell: ``1.23x (1.18–1.31)``."""
        return f"{self.median:.2f}x ({self.min:.2f}–{self.max:.2f})"


def _measured(value: Figure) -> bool:
    """Rates and times are positive: None, NaN or a non-positive figure means nothing
    was measured on that side (a failed run, a latency the round did not have)."""
    return value is not None and not math.isnan(value) and value > 0


def summarize_ratios(ratios: Sequence[Figure]) -> PairedRatio | None:
    """The statistic of per-round ratios already taken; the rounds without one dropped.
    None when no round has one."""
    kept = tuple(float(r) for r in ratios if _measured(r))
    if not kept:
        return None
    return PairedRatio(statistics.median(kept), min(kept), max(kept), len(kept), kept)


def paired_ratio(numerators: Sequence[Figure], denominators: Sequence[Figure]
                 ) -> PairedRatio | None:
    """``numerators[r] / denominators[r]`` for each round ``r`` that both sides
    completed; a round where either failed is dropped from both. The lists are the same
    rounds in the same order, so they must be equally long."""
    if len(numerators) != len(denominators):
        raise ValueError(f"paired rounds need equally many figures a side, got "
                         f"{len(numerators)} and {len(denominators)}")
    return summarize_ratios([a / b if _measured(a) and _measured(b) else None
                             for a, b in zip(numerators, denominators)])


def ratio_cell(ratio: PairedRatio | None) -> str:
    """A table cell for a ratio; ``-`` where there is none."""
    return "-" if ratio is None else ratio.cell()


def describe_ratio(ratio: PairedRatio | None) -> str:
    """A ratio in words, or why there is none."""
    return "no round measured both sides" if ratio is None else ratio.describe()

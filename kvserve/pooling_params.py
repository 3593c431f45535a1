"""PoolingParams: what an embedding request asks of the prompt's hidden states, as
vLLM's: how they are pooled into one vector, whether it is normalised, and to how many
dimensions it is cut (models trained for that, Matryoshka)."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """None fields take the model's own (see kvserve.model.pooling_config)."""

    pooling: str | None = None   # last | mean | cls: the last token's, the mean, the first
    normalize: bool | None = None
    dimensions: int | None = None  # keep the first N (then normalise, if normalising)

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {list(POOLING_TYPES)}, got "
                             f"{self.pooling!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")

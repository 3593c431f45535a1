"""The fixed benchmark workloads of ``shared/BENCHMARKS.md`` as deterministic data.

Prompt token ids are drawn (seeded) from a model's vocabulary with its special
token ids excluded, so any model can run any workload. Generation is done per
request in order, so the first N requests of a workload do not depend on how many
are asked for.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Iterable, Sequence

__all__ = [
    "BenchRequest",
    "Workload",
    "WORKLOAD_NAMES",
    "make_workload",
    "mixed_workload",
    "shared_prefix_workload",
    "random_workload",
    "poisson_arrival_times",
]

WORKLOAD_NAMES: tuple[str, ...] = ("mixed", "shared-prefix", "random")


@dataclass(frozen=True)
class BenchRequest:
    """One request: the prompt as token ids and the number of tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    """A named, seeded list of requests."""

    name: str
    requests: list[BenchRequest]
    seed: int = 0
    params: dict[str, object] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        """Sum of prompt lengths."""
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Sum of ``max_tokens`` (the useful output tokens of the workload)."""
        return sum(r.max_tokens for r in self.requests)

    def describe(self) -> dict[str, object]:
        """A JSON-able summary (no token ids)."""
        plens = [r.prompt_len for r in self.requests] or [0]
        olens = [r.max_tokens for r in self.requests] or [0]
        return {
            "name": self.name,
            "seed": self.seed,
            "num_requests": len(self.requests),
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "prompt_len_min_max": [min(plens), max(plens)],
            "output_len_min_max": [min(olens), max(olens)],
            **self.params,
        }


def _allowed_ids(vocab_size: int, special_ids: Iterable[int]) -> list[int]:
    excluded = set(special_ids)
    allowed = [i for i in range(vocab_size) if i not in excluded]
    if not allowed:
        raise ValueError("no token ids left after excluding the special ids")
    return allowed


def _tokens(rng: random.Random, allowed: Sequence[int], n: int) -> list[int]:
    return rng.choices(allowed, k=n)


def mixed_workload(
    vocab_size: int,
    special_ids: Iterable[int] = (),
    num_requests: int = 128,
    seed: int = 0,
    prompt_range: tuple[int, int] = (16, 512),
    output_range: tuple[int, int] = (16, 256),
) -> Workload:
    """``mixed``: prompt length uniform 16..512, output uniform 16..256 (inclusive)."""
    rng = random.Random(seed)
    allowed = _allowed_ids(vocab_size, special_ids)
    reqs = []
    for _ in range(num_requests):
        plen = rng.randint(*prompt_range)
        olen = rng.randint(*output_range)
        reqs.append(BenchRequest(_tokens(rng, allowed, plen), olen))
    params = {"prompt_range": list(prompt_range), "output_range": list(output_range)}
    return Workload("mixed", reqs, seed, params)


def shared_prefix_workload(
    vocab_size: int,
    special_ids: Iterable[int] = (),
    num_requests: int = 64,
    seed: int = 0,
    prefix_len: int = 384,
    unique_len: int = 32,
    output_len: int = 32,
    num_prefixes: int = 1,
) -> Workload:
    """``shared-prefix``: a shared 384-token prefix + 32 unique tokens, 32 output tokens.
    With ``num_prefixes`` > 1 each request draws one of that many prefixes at random (the
    users of a few system prompts, interleaved)."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = random.Random(seed)
    allowed = _allowed_ids(vocab_size, special_ids)
    prefixes = [_tokens(rng, allowed, prefix_len) for _ in range(num_prefixes)]
    reqs = []
    for _ in range(num_requests):
        prefix = prefixes[rng.randrange(num_prefixes)] if num_prefixes > 1 else prefixes[0]
        reqs.append(BenchRequest(prefix + _tokens(rng, allowed, unique_len), output_len))
    params = {"prefix_len": prefix_len, "unique_len": unique_len}
    if num_prefixes > 1:
        params["num_prefixes"] = num_prefixes
    return Workload("shared-prefix", reqs, seed, params)


def random_workload(
    vocab_size: int,
    special_ids: Iterable[int] = (),
    num_requests: int = 128,
    seed: int = 0,
    input_len: int = 128,
    output_len: int = 128,
) -> Workload:
    """Fixed lengths: ``num_requests`` prompts of ``input_len`` tokens, ``output_len`` out."""
    rng = random.Random(seed)
    allowed = _allowed_ids(vocab_size, special_ids)
    reqs = [BenchRequest(_tokens(rng, allowed, input_len), output_len) for _ in range(num_requests)]
    return Workload("random", reqs, seed, {"input_len": input_len, "output_len": output_len})


def make_workload(
    name: str,
    vocab_size: int,
    special_ids: Iterable[int] = (),
    seed: int = 0,
    num_prompts: int | None = None,
    input_len: int | None = None,
    output_len: int | None = None,
    num_prefixes: int = 1,
) -> Workload:
    """A workload by name; ``num_prompts`` overrides the request count of any workload,
    ``input_len``/``output_len`` apply to ``random`` (and the output of ``shared-prefix``),
    ``num_prefixes`` to ``shared-prefix``."""
    kw: dict[str, int] = {} if num_prompts is None else {"num_requests": num_prompts}
    special = list(special_ids)
    if num_prefixes != 1 and name != "shared-prefix":
        raise ValueError("num_prefixes applies to the shared-prefix workload only")
    if name == "mixed":
        if input_len is not None or output_len is not None:
            raise ValueError("mixed has fixed length ranges; use --workload random for fixed lengths")
        return mixed_workload(vocab_size, special, seed=seed, **kw)
    if name == "shared-prefix":
        if input_len is not None:
            raise ValueError("shared-prefix has fixed prompt lengths (384 shared + 32 unique)")
        if output_len is not None:
            kw["output_len"] = output_len
        return shared_prefix_workload(vocab_size, special, seed=seed,
                                      num_prefixes=num_prefixes, **kw)
    if name == "random":
        return random_workload(
            vocab_size,
            special,
            seed=seed,
            input_len=128 if input_len is None else input_len,
            output_len=128 if output_len is None else output_len,
            **kw,
        )
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOAD_NAMES)}")


def poisson_arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds for ``n`` requests of a Poisson process at ``rate`` req/s.

    The first request arrives at 0; gaps are exponential with mean ``1/rate``.
    ``rate=inf`` sends everything at once (all offsets 0).
    """
    if n <= 0:
        return []
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times

"""Routers: which replica serves a request. One interface, registered in ``ROUTERS``.

A router sees the prompt's block keys (``prefix_index.block_keys``) and each replica's
load (requests the ingress has in flight there) and health; it returns a
``RouteDecision``. ``reason`` is what ``/metrics`` counts:
``cache_hit`` | ``cache_miss`` | ``imbalance`` | ``round_robin``.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from kvserve.config.replicas import ReplicaConfig
from kvserve.registry import Registry
from kvserve.replicas.prefix_index import PrefixIndex


@dataclass(frozen=True)
class RouteDecision:
    replica: int
    reason: str
    match_ratio: float  # the chosen replica's matched share of the prompt's blocks


class NoReplicaError(RuntimeError):
    """Every replica is down (restarting)."""


class Router(ABC):
    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.index = PrefixIndex(config.num_replicas, config.prefix_index_blocks)

    @abstractmethod
    def choose(self, keys: Sequence[int], loads: Sequence[int],
               healthy: Sequence[bool]) -> RouteDecision:
        """Pick a healthy replica; raise NoReplicaError when there is none."""

    def route(self, keys: Sequence[int], loads: Sequence[int],
              healthy: Sequence[bool]) -> RouteDecision:
        decision = self.choose(keys, loads, healthy)
        self.index.insert(keys, decision.replica)
        return decision

    def _ratio(self, keys: Sequence[int], replica: int) -> float:
        return self.index.match(keys, replica) / len(keys) if keys else 0.0

    @staticmethod
    def _candidates(healthy: Sequence[bool]) -> list[int]:
        up = [i for i, ok in enumerate(healthy) if ok]
        if not up:
            raise NoReplicaError("no replica is up (they are restarting); retry shortly")
        return up


ROUTERS: Registry[type[Router]] = Registry("router")


@ROUTERS.register("round_robin")
class RoundRobinRouter(Router):
    """Each healthy replica in turn, blind to caches and load (the baseline)."""

    def __init__(self, config: ReplicaConfig) -> None:
        super().__init__(config)
        self._turn = itertools.count()

    def choose(self, keys, loads, healthy) -> RouteDecision:
        up = self._candidates(healthy)
        replica = up[next(self._turn) % len(up)]
        return RouteDecision(replica, "round_robin", self._ratio(keys, replica))


@ROUTERS.register("cache_aware")
class CacheAwareRouter(Router):
    """The longest cached prefix wins unless its replica is overloaded (see ReplicaConfig).
    ``imbalance`` counts only the requests a cache hit would have taken elsewhere."""

    def choose(self, keys, loads, healthy) -> RouteDecision:
        up = self._candidates(healthy)
        least = min(up, key=lambda i: (loads[i], self.index.size(i), i))
        matches = {i: self.index.match(keys, i) for i in up}
        best = max(up, key=lambda i: (matches[i], -loads[i], -i))
        ratio = matches[best] / len(keys) if keys else 0.0
        cfg = self.config
        if keys and ratio >= cfg.cache_threshold and matches[best] > 0:
            if (loads[best] - loads[least] > cfg.balance_abs_threshold
                    and loads[best] > cfg.balance_rel_threshold * loads[least]):
                return RouteDecision(least, "imbalance", self._ratio(keys, least))
            return RouteDecision(best, "cache_hit", ratio)
        return RouteDecision(least, "cache_miss", self._ratio(keys, least))

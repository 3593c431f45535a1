"""ReplicaConfig: data-parallel engine replicas on Ray Serve and how requests are routed."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.validate import positive_int

MAX_REPLICAS = 256


@dataclass(frozen=True)
class ReplicaConfig:
    """``num_replicas`` engines, each a Ray Serve deployment, behind one ingress.

    Routing (``cache_aware``): a request goes to the replica whose prefix index holds the
    longest prefix of its prompt when that prefix is at least ``cache_threshold`` of the
    prompt, unless that replica carries more than ``balance_abs_threshold`` requests
    above the least-loaded one and more than ``balance_rel_threshold`` times its load;
    otherwise to the least-loaded replica. The thresholds are SGLang's router's defaults;
    unlike SGLang, the load test compares the cache's candidate with the least-loaded
    replica, not the busiest replica with it, and a miss goes to the least loaded.
    """

    num_replicas: int = 1
    ray_address: str | None = None       # None: start a local Ray
    router: str = "cache_aware"          # a name in kvserve.replicas.routers.ROUTERS
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    threads_per_replica: int | None = None  # None: the cores divided among the replicas
    prefix_index_blocks: int = 1 << 16      # per replica; the index forgets its LRU blocks

    def __post_init__(self) -> None:
        positive_int("replicas", self.num_replicas)
        if self.num_replicas > MAX_REPLICAS:
            raise ValueError(f"replicas must be at most {MAX_REPLICAS}, got {self.num_replicas}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"router_cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"router_balance_abs_threshold must be >= 0, got "
                             f"{self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"router_balance_rel_threshold must be >= 1, got "
                             f"{self.balance_rel_threshold}")
        if self.threads_per_replica is not None:
            positive_int("threads_per_replica", self.threads_per_replica)
        positive_int("router_prefix_index_blocks", self.prefix_index_blocks)

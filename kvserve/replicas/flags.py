"""``kvserve serve``'s flags: the server's, the replicas' and the engine's, in one place
for the command line and for the Ray Serve application; and the :class:`ReplicaConfig`
they make, checked before anything loads (the router's name against ``ROUTERS``)."""
from __future__ import annotations

import argparse

from kvserve.config.replicas import ReplicaConfig
from kvserve.engine.engine_args import EngineArgs
from kvserve.entrypoints.config_file import add_config_argument
from kvserve.entrypoints.openai.cli_args import add_server_args
from kvserve.replicas.routers import ROUTERS


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of ``kvserve serve``: the server's, the replicas', the engine's, --config."""
    add_server_args(p)
    add_replica_args(p)
    EngineArgs.add_cli_args(p, skip=("model",))
    add_config_argument(p)


def add_replica_args(p: argparse.ArgumentParser) -> None:
    d = ReplicaConfig()
    g = p.add_argument_group("replicas on Ray Serve (pip install 'kvserve[ray]')")
    g.add_argument("--replicas", type=int, default=None,
                   help="run N engine replicas as Ray Serve deployments behind one ingress "
                        "(default: one engine in this process, no Ray)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster from one of its nodes: auto or HOST:6379 "
                        "(default: start a local Ray)")
    g.add_argument("--router", default=d.router, choices=ROUTERS.names(),
                   help=f"how the ingress picks a replica (default: {d.router})")
    g.add_argument("--router-cache-threshold", type=float, default=d.cache_threshold,
                   help="route to the replica with the longest cached prefix when it covers "
                        f"at least this share of the prompt (default: {d.cache_threshold})")
    g.add_argument("--router-balance-abs-threshold", type=int,
                   default=d.balance_abs_threshold,
                   help="...unless that replica has more than this many requests above the "
                        f"least-loaded one (default: {d.balance_abs_threshold})")
    g.add_argument("--router-balance-rel-threshold", type=float,
                   default=d.balance_rel_threshold,
                   help="...and more than this times its load; then the least-loaded "
                        f"replica serves (default: {d.balance_rel_threshold})")
    g.add_argument("--threads-per-replica", type=int, default=None,
                   help="compute threads (and Ray CPUs) per replica, each replica on its "
                        "own cores (default: the cores divided among the replicas)")


def wants_replicas(args: argparse.Namespace) -> bool:
    """Whether ``kvserve serve``'s flags ask for replicas (``--ray-address`` alone is
    refused by :func:`replica_config_from`)."""
    return args.replicas is not None or args.ray_address is not None


def replica_config_from(args: argparse.Namespace) -> ReplicaConfig:
    """The replicas' settings from ``kvserve serve``'s flags, checked."""
    if args.replicas is None:
        raise ValueError("--ray-address needs --replicas N (the replicas it would run)")
    if (args.ray_address or "").startswith("ray://"):
        raise ValueError("--ray-address: Ray Client (ray://) cannot stream from Serve "
                         "deployments; run kvserve on a node of the cluster with "
                         "--ray-address auto (or HOST:6379), or deploy "
                         "kvserve.replicas.serve_app (see docs/replicas.md)")
    config = ReplicaConfig(
        num_replicas=args.replicas, ray_address=args.ray_address, router=args.router,
        cache_threshold=args.router_cache_threshold,
        balance_abs_threshold=args.router_balance_abs_threshold,
        balance_rel_threshold=args.router_balance_rel_threshold,
        threads_per_replica=args.threads_per_replica)
    ROUTERS.check(config.router)
    return config

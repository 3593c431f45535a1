"""``kvserve serve --replicas N``: N engine replicas on Ray Serve, one ingress in front.

Ray Serve owns the replicas: each is one deployment (``kvserve-replica-I``, one replica
of :class:`EngineReplica`) holding ``threads_per_replica`` CPUs, health-checked and
restarted by Serve when it dies. Serve's own HTTP proxy is off: this process serves
HTTP with uvicorn and the :class:`Ingress`, which calls the replicas through their
deployment handles, so the router (not Serve's load balancing) picks the replica. (The
same replicas behind Serve's proxy, for KubeRay: ``serve_app.py``.)
"""
from __future__ import annotations

import argparse
import os
from dataclasses import replace

from kvserve.config.replicas import ReplicaConfig
from kvserve.entrypoints.openai.api_server import APIKeyMiddleware, ServerSettings, usage_hint
from kvserve.entrypoints.openai.graceful import GracefulServer
from kvserve.logger import init_logger
from kvserve.replicas.flags import replica_config_from
from kvserve.replicas.ingress import Ingress
from kvserve.replicas.replica import EngineReplica
from kvserve.worker.platform import one_cpu_per_core

logger = init_logger(__name__)

HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0


def _replica_threads(config: ReplicaConfig, engine_args,
                     cluster: bool = False) -> tuple[int, list[str]]:
    """Threads per replica and each replica's CPU binding: disjoint cores when they fit
    on this machine. On a cluster (``cluster``, or joined with ``ray_address``) the
    replicas land on other nodes, so nothing is bound and the threads default to one."""
    cluster = cluster or bool(config.ray_address)
    cpus = one_cpu_per_core()
    n = config.num_replicas
    threads = (config.threads_per_replica or engine_args.num_threads
               or (1 if cluster else max(1, len(cpus) // n)))
    if engine_args.omp_threads_bind != "auto" or cluster or threads * n > len(cpus):
        bind = engine_args.omp_threads_bind if engine_args.omp_threads_bind != "auto" else "nobind"
        return threads, [bind] * n
    return threads, [",".join(map(str, cpus[i * threads:(i + 1) * threads])) for i in range(n)]


def replica_applications(config: ReplicaConfig, settings, shutdown_timeout_s: float,
                         cluster: bool = False) -> list:
    """The replicas' bound Serve deployments, in replica order; replica 0 owns the
    Batch API's store."""
    from ray import serve

    threads, binds = _replica_threads(config, settings.engine_args, cluster)
    bound = []
    for i in range(config.num_replicas):
        deployment = serve.deployment(
            EngineReplica, name=f"kvserve-replica-{i}", num_replicas=1,
            ray_actor_options={"num_cpus": threads},
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S, max_ongoing_requests=100_000,
            graceful_shutdown_timeout_s=shutdown_timeout_s)
        engine_args = replace(settings.engine_args, num_threads=threads,
                              omp_threads_bind=binds[i])
        app = dict(settings.app, batch=settings.app["batch"] if i == 0 else None)
        logger.info("replica %d: %d threads, CPUs %s", i, threads, binds[i])
        bound.append(deployment.bind(i, engine_args, settings.observability, app))
    return bound


def deploy_replicas(config: ReplicaConfig, settings, shutdown_timeout_s: float
                    ) -> tuple[list, list[str], bool]:
    """Start (or join) Ray, start Serve without its proxy, deploy each replica as its own
    application; return their deployment handles in replica order, the application
    names (unique to this server, so that two never replace each other's) and whether
    this process started Ray."""
    import uuid

    import ray
    from ray import serve

    started = not ray.is_initialized() and not config.ray_address
    if not ray.is_initialized():
        if config.ray_address:
            ray.init(address=config.ray_address, include_dashboard=False)
        else:
            threads, _ = _replica_threads(config, settings.engine_args)
            ray.init(num_cpus=max(os.cpu_count() or 1, threads * config.num_replicas),
                     include_dashboard=False)
    serve.start(http_options={"location": "NoServer"})
    tag = uuid.uuid4().hex[:8]
    names = [f"kvserve-{tag}-{i}" for i in range(config.num_replicas)]
    apps = replica_applications(config, settings, shutdown_timeout_s)
    return ([serve.run(app, name=name, route_prefix=None) for app, name in zip(apps, names)],
            names, started)


def run_replicated_server(args: argparse.Namespace) -> int:
    """``kvserve serve --replicas N``: check the flags, deploy the replicas, serve until
    SIGTERM / SIGINT, then drain, shut Serve down and exit 0."""
    settings = ServerSettings.from_args(args)
    config = replica_config_from(args)  # refuse bad replica settings before loading anything
    hint = usage_hint(args.host, args.port, settings.name, bool(settings.api_key))
    from ray import serve  # the optional extra, needed only once the flags are good

    handles, names, started_ray = deploy_replicas(config, settings, args.shutdown_timeout)
    ingress = Ingress(handles, config, args.metrics_prefix, args.max_body_bytes,
                      args.max_batch_file_bytes)
    app = APIKeyMiddleware(ingress, settings.api_key) if settings.api_key else ingress
    server = GracefulServer(app, args, hint, lambda: ingress.abort_all(
        "the server is shutting down"))
    try:
        server.run()
    finally:
        if started_ray:
            serve.shutdown()
        else:  # a shared cluster: remove only this server's applications
            for name in names:
                serve.delete(name)
    return 0 if server.started else 1

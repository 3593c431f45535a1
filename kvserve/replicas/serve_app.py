"""The replicas and the ingress as one Ray Serve application, for a Serve config file or
KubeRay's RayService::

    applications:
      - name: kvserve
        route_prefix: /
        import_path: kvserve.replicas.serve_app:build
        args:
          argv: ["--replicas", "2", "--threads-per-replica", "2"]

``argv`` is ``kvserve serve``'s own flags (the model directory first, if not the
embedded one), parsed and checked by the same parser, so each setting means what it
means on the command line; on a cluster the replicas are not bound to CPUs and take
one thread each unless ``--threads-per-replica`` says otherwise. Here Serve's HTTP proxy carries the requests to the ingress
deployment; ``--host``, ``--port`` and ``--ray-address`` are Serve's business and are
refused. The API key comes from ``$KVSERVE_API_KEY`` in the ingress's environment.
"""
from __future__ import annotations

import os

from ray import serve

from kvserve.config.replicas import ReplicaConfig
from kvserve.entrypoints.config_file import ConfigFileParser
from kvserve.entrypoints.openai.api_server import APIKeyMiddleware, ServerSettings
from kvserve.replicas.flags import add_serve_args, replica_config_from
from kvserve.replicas.ingress import Ingress
from kvserve.replicas.launch import replica_applications

_SERVE_OWNS = ("--host", "--port", "--ray-address")


@serve.ingress()
class KvserveIngress:
    """Ray Serve's ingress deployment: the :class:`Ingress` ASGI app over the replicas."""

    def __init__(self, config: ReplicaConfig, metrics_prefix: str, max_body_bytes: int,
                 max_file_bytes: int, api_key: str | None, *replicas) -> None:
        self.ingress = Ingress(list(replicas), config, metrics_prefix, max_body_bytes,
                               max_file_bytes)
        self.asgi = APIKeyMiddleware(self.ingress, api_key) if api_key else self.ingress

    def __serve_build_asgi_app__(self):
        return self.asgi


def parse_argv(argv: list[str]):
    """``kvserve serve`` flags -> (the parsed namespace, its ServerSettings)."""
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"args.argv must be a list of strings (kvserve serve's flags), "
                         f"got {argv!r}")
    owned = [a for a in argv if a.split("=", 1)[0] in _SERVE_OWNS]
    if owned:
        raise ValueError(f"{', '.join(owned)}: set by Ray Serve's config (http_options, "
                         f"the cluster), not by args.argv")
    parser = ConfigFileParser(prog="kvserve serve", allow_abbrev=False)  # "--po" must not
    add_serve_args(parser)                                     # slip past the check above
    args = parser.parse_args(argv)
    if args.replicas is None:
        args.replicas = 1
    return args, ServerSettings.from_args(args)


def build(app_args: dict):
    """Serve's application builder: ``args`` of the config's application."""
    unknown = sorted(set(app_args) - {"argv"})
    if unknown:
        raise ValueError(f"unknown args {unknown}: the application takes only 'argv'")
    args, settings = parse_argv(app_args.get("argv", []))
    config = replica_config_from(args)
    api_key = settings.api_key or os.environ.get("KVSERVE_API_KEY") or None
    # the ingress reserves no CPU: the engines' replicas hold the cores
    ingress = serve.deployment(KvserveIngress, name="kvserve-ingress",
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000,
                               graceful_shutdown_timeout_s=args.shutdown_timeout)
    return ingress.bind(
        config, args.metrics_prefix, args.max_body_bytes, args.max_batch_file_bytes, api_key,
        *replica_applications(config, settings, args.shutdown_timeout, cluster=True))

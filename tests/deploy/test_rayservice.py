"""deploy/kubernetes/rayservice.yaml, offline: its pod templates against the Kubernetes
schemas (kubernetes-validate, strict), its serveConfigV2 against Ray Serve's own config
schema, and its application's import path and `kvserve serve` flags against kvserve."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import yaml

from tests.deploy.k8s_manifests import K8S_DIR, k8s_versions, load_one
from tests.deploy.tools import require_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rayservice() -> dict:
    doc = load_one("rayservice.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    return doc


@pytest.fixture(scope="module")
def serve_config(rayservice) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def _templates(rayservice) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster["workerGroupSpecs"]:
        out[group["groupName"]] = group["template"]
    return out


@pytest.mark.parametrize("version", k8s_versions())
def test_pod_templates_validate_strictly(rayservice, version):
    kv = require_module("kubernetes_validate", "kubernetes-validate")
    for name, template in _templates(rayservice).items():
        doc = {"apiVersion": "v1", "kind": "PodTemplate",
               "metadata": {"name": f"kvserve-{name}"}, "template": template}
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"the {name} pod template is invalid for Kubernetes {version} at "
                        f"{'.'.join(map(str, e.path))}: {e.message}")


def test_serve_config_is_valid_for_ray_serve(serve_config):
    schema = require_module("ray.serve.schema", "'kvserve[ray]'")
    schema.ServeDeploySchema.model_validate(serve_config)
    assert serve_config["http_options"]["port"] == 8000


def test_the_application_builds_from_its_flags(serve_config):
    require_module("ray.serve", "'kvserve[ray]'")
    (app,) = serve_config["applications"]
    module, _, attr = app["import_path"].partition(":")
    build = getattr(importlib.import_module(module), attr)
    from kvserve.replicas.serve_app import parse_argv
    args, settings = parse_argv(app["args"]["argv"])
    assert args.replicas == 2 and args.threads_per_replica == 2
    assert settings.engine_args.omp_threads_bind == "nobind"
    from ray.serve import Application
    assert isinstance(build(app["args"]), Application)  # bound, not deployed
    with pytest.raises(ValueError, match="set by Ray Serve"):
        parse_argv(["--port", "9000"])
    with pytest.raises(ValueError, match="only 'argv'"):
        build({"argv": [], "replicas": 3})


def test_workers_fit_a_replica_each_and_the_head_holds_the_key(rayservice, serve_config):
    argv = serve_config["applications"][0]["args"]["argv"]
    threads = int(argv[argv.index("--threads-per-replica") + 1])
    cluster = rayservice["spec"]["rayClusterConfig"]
    (engines,) = cluster["workerGroupSpecs"]
    assert int(engines["rayStartParams"]["num-cpus"]) == threads
    (worker,) = engines["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["cpu"] == str(threads)
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in head["env"]}
    secret = load_one("secret.yaml")
    assert env["KVSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == \
        secret["metadata"]["name"]


def test_ray_version_is_the_pinned_one(rayservice):
    pinned = re.search(r'"ray\[serve\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned, "pyproject.toml must pin ray[serve]"
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == pinned.group(1)
    assert K8S_DIR.joinpath("rayservice.yaml").is_file()

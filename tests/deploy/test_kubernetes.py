"""The Kubernetes manifests in deploy/kubernetes, checked offline.

Built-in kinds are validated, strictly (unknown fields rejected), against the OpenAPI
schemas that kubernetes-validate ships for several Kubernetes versions. Custom resources
(PodMonitor, ServiceMonitor) and the Kustomization have no schema there:
they are checked field by field (test_kubernetes_deployment.py checks what the
manifests say).
"""
from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest
import yaml

from tests.deploy.k8s_manifests import CUSTOM_KINDS, K8S_DIR, MIN_K8S_VERSION, deployment, \
    k8s_versions, load_docs, manifest_files, pod_spec, server_container, \
    uncomment_model_example
from tests.deploy.tools import require_module


@pytest.fixture(scope="module")
def kv():
    return require_module("kubernetes_validate", "kubernetes-validate")


# ------------------------------------------------------------ schema validation

def test_every_manifest_has_kind_and_name():
    files = manifest_files()
    assert {p.name for p in files} >= {
        "deployment.yaml", "service.yaml", "secret.yaml", "hpa.yaml", "prometheus-adapter.yaml",
        "podmonitor.yaml", "servicemonitor.yaml", "kustomization.yaml"}
    for path in files:
        docs = load_docs(path)
        assert docs, f"{path.name}: empty"
        for doc in docs:
            assert isinstance(doc, dict), path.name
            for key in ("apiVersion", "kind"):
                assert isinstance(doc.get(key), str) and doc[key], f"{path.name}: no {key}"
            if doc["kind"] != "Kustomization":
                assert doc.get("metadata", {}).get("name"), f"{path.name}: no metadata.name"
                assert "spec" in doc or "data" in doc or "stringData" in doc, path.name


def _built_in(doc: dict) -> bool:
    return (doc["apiVersion"], doc["kind"]) not in CUSTOM_KINDS


@pytest.mark.parametrize("version", k8s_versions())
@pytest.mark.parametrize("name", [p.name for p in manifest_files()])
def test_manifest_validates_strictly(kv, name, version):
    """Built-in kinds against the schema; custom kinds must really have none (so that
    the structural tests below are what covers them, and a typo'd kind is not skipped)."""
    for doc in load_docs(K8S_DIR / name):
        if _built_in(doc):
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{name}: {doc['kind']} invalid for Kubernetes {version} "
                            f"at {path}: {e.message}")
        else:
            with pytest.raises(kv.SchemaNotFoundError):
                kv.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", k8s_versions())
def test_model_pvc_example_validates(kv, version):
    """The commented kvserve-models example, switched on, is still a valid Deployment."""
    dep = yaml.safe_load(uncomment_model_example((K8S_DIR / "deployment.yaml").read_text()))
    kv.validate(dep, version, strict=True)


def test_cli_validates_the_built_in_manifests(kv):
    """The command line as a user runs it, over every file: exit 0, no ERROR line."""
    files = [str(p) for p in manifest_files()]
    res = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict",
                          "--kubernetes-version", MIN_K8S_VERSION, *files],
                         capture_output=True, text=True, timeout=120, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "ERROR" not in out and "FATAL" not in out, out
    passed = set(re.findall(r"INFO (\S+) passed", out))
    built_in = {str(p) for p in manifest_files() if all(_built_in(d) for d in load_docs(p))}
    assert built_in <= passed, f"not validated: {sorted(built_in - passed)}\n{out}"


def _broken(mutate) -> dict:
    dep = copy.deepcopy(deployment())
    mutate(dep)
    return dep


BROKEN = {
    "replicas-not-int": lambda d: d["spec"].__setitem__("replicas", "one"),
    "unknown-container-field": lambda d: server_container(d).__setitem__(
        "livenessprobe", server_container(d).pop("livenessProbe")),
    "port-not-int": lambda d: server_container(d)["ports"][0].__setitem__(
        "containerPort", "8000"),
    "container-without-name": lambda d: pod_spec(d)["containers"][0].pop("name"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_validator_rejects_broken_deployment(kv, case):
    """The validation above can fail: the same Deployment, broken, is rejected."""
    with pytest.raises(kv.ValidationError):
        kv.validate(_broken(BROKEN[case]), MIN_K8S_VERSION, strict=True)


def test_strict_mode_is_what_catches_unknown_fields(kv):
    dep = _broken(BROKEN["unknown-container-field"])
    kv.validate(dep, MIN_K8S_VERSION, strict=False)  # a typo'd field passes loose checks
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, MIN_K8S_VERSION, strict=True)


def test_cli_exits_nonzero_on_a_broken_manifest(kv, tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text(yaml.safe_dump(_broken(BROKEN["replicas-not-int"])))
    res = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict",
                          "--kubernetes-version", MIN_K8S_VERSION, str(bad)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "ERROR" in res.stdout, res.stdout

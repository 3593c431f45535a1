"""Loading and reading deploy/kubernetes's manifests, for the tests that check them."""
from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "kubernetes"
# Oldest Kubernetes the manifests aim at; the newest schema shipped is checked too.
MIN_K8S_VERSION = "1.30"
# Kinds without a schema in kubernetes-validate, checked structurally below.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"),
                ("monitoring.coreos.com/v1", "ServiceMonitor"),
                ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
                ("ray.io/v1", "RayService")}
# In the directory but deliberately not in kustomization.yaml (see its comment).
NOT_IN_KUSTOMIZATION = {"kustomization.yaml", "servicemonitor.yaml",
                        "prometheus-adapter.yaml", "rayservice.yaml"}
# The series the HPA scales on, as kvserve exports it (default --metrics-prefix).
QUEUE_SERIES = "kvserve:num_requests_waiting"
MODEL_LINE_MARK = "#M "  # deployment.yaml's commented kvserve-models PVC example


def k8s_versions() -> list[str]:
    try:
        from kubernetes_validate import latest_version
    except ImportError:
        return [MIN_K8S_VERSION]
    return sorted({MIN_K8S_VERSION, latest_version()})


# ---------------------------------------------------------------------------- loading

def manifest_files() -> list[Path]:
    return sorted(K8S_DIR.glob("*.yaml"))


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def load_one(name: str) -> dict:
    docs = load_docs(K8S_DIR / name)
    assert len(docs) == 1, f"{name}: expected one document, found {len(docs)}"
    return docs[0]


def uncomment_model_example(text: str) -> str:
    """deployment.yaml with its kvserve-models example switched on, as its comment says
    (sed -i 's/#M //')."""
    return text.replace(MODEL_LINE_MARK, "")


@functools.cache
def _serve_parser():
    from kvserve.cli import build_parser
    return build_parser()


def serve_option_strings() -> set[str]:
    """Every option of ``kvserve serve``, spelled out in full."""
    parser = _serve_parser()
    sub, = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices["serve"]._option_string_actions)


def parse_serve_args(args: list[str]):
    """The container args as ``kvserve serve`` parses them (the image's ENTRYPOINT).
    Flags must be spelled out: argparse would also take a typo that is a prefix."""
    flags = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    unknown = flags - serve_option_strings()
    assert not unknown, f"not kvserve serve options (in full): {sorted(unknown)}"
    return _serve_parser().parse_args(["serve", *args])


def deployment() -> dict:
    return load_one("deployment.yaml")


def pod_spec(dep: dict | None = None) -> dict:
    return (dep or deployment())["spec"]["template"]["spec"]


def server_container(dep: dict | None = None) -> dict:
    containers = pod_spec(dep)["containers"]
    named = [c for c in containers if c["name"] == "kvserve"]
    assert len(named) == 1, "deployment.yaml: expected one container named kvserve"
    return named[0]


def named_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def labels_match(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def prestop_sleep_seconds(container: dict) -> float:
    pre = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:  # the PodLifecycleSleepAction form
        return float(pre["sleep"]["seconds"])
    if "exec" in pre:
        cmd = pre["exec"]["command"]
        if cmd[0] in ("sleep", "/bin/sleep") and len(cmd) == 2:
            return float(cmd[1])
        match = re.search(r"\bsleep\s+(\d+(?:\.\d+)?)", " ".join(cmd))
        if match:
            return float(match.group(1))
    return 0.0

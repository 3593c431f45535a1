"""deploy/kubernetes's manifests checked against each other (labels and selectors, named
ports, Secret, HPA metric vs adapter rule, drain vs grace period) and against kvserve
itself (its CLI parser accepts the arguments, it exports the series the autoscaler reads).
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.deploy.k8s_manifests import K8S_DIR, MODEL_LINE_MARK, NOT_IN_KUSTOMIZATION, \
    QUEUE_SERIES, ROOT, deployment, labels_match, load_one, manifest_files, named_ports, \
    parse_serve_args, pod_spec, prestop_sleep_seconds, server_container, \
    uncomment_model_example


# ------------------------------------------------------------------- Deployment

def test_deployment_basics():
    dep = deployment()
    assert dep["metadata"]["name"] == "kvserve"
    assert dep["spec"]["replicas"] == 1
    template_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert template_labels.get("app.kubernetes.io/name") == "kvserve"
    # the API server rejects a selector that does not match the template's labels
    assert labels_match(dep["spec"]["selector"]["matchLabels"], template_labels)
    c = server_container(dep)
    assert c["image"] == "kvserve:0.1.0"
    assert named_ports(c) == {"http": 8000}
    assert "command" not in c, "command would replace the image's `kvserve serve` entrypoint"


def test_container_args_are_kvserve_serve_flags():
    """kvserve's own parser accepts them (unknown flags or bad values exit 2)."""
    c = server_container()
    args = parse_serve_args([str(a) for a in c["args"]])
    assert args.host == "0.0.0.0"
    assert args.port == named_ports(c)["http"]
    assert args.model is None, "the default is the embedded model"
    assert args.state_dir == "/var/lib/kvserve"


def test_state_dir_and_writable_paths_are_volumes():
    """With a read-only root filesystem every path kvserve writes must be a mounted
    volume: the state dir, /tmp (also where gcc writes while building the kernels)."""
    spec, c = pod_spec(), server_container()
    args = parse_serve_args([str(a) for a in c["args"]])
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for m in c["volumeMounts"]:
        assert m["name"] in volumes, f"mount of undefined volume {m['name']}"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    for path in (args.state_dir, "/tmp"):
        assert path in mounts, f"{path} is not a volume"
        assert not mounts[path].get("readOnly"), path
        vol = volumes[mounts[path]["name"]]
        assert "emptyDir" in vol or "persistentVolumeClaim" in vol, vol


def test_probes_use_health_on_the_named_port():
    c = server_container()
    ports = named_ports(c)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]
        assert probe["httpGet"]["path"] == "/health", kind
        port = probe["httpGet"]["port"]
        assert port == "http" and port in ports, f"{kind}: port {port!r}"
    startup = c["startupProbe"]
    # model load + kernel build + GEMM warm-up: allow at least a minute
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60
    live = c["livenessProbe"]
    assert live["timeoutSeconds"] < live["periodSeconds"]
    assert live["failureThreshold"] >= 2, "one slow answer must not restart the server"


def test_resources_and_engine_threads():
    c = server_container()
    res = c["resources"]
    for part in ("requests", "limits"):
        assert str(res[part]["cpu"]) == "2", part
        assert res[part]["memory"] == "8Gi", part
    args = parse_serve_args([str(a) for a in c["args"]])
    assert args.num_threads == int(res["limits"]["cpu"]), "one compute thread per CPU"
    if args.kv_cache_memory is not None:
        from kvserve.config.validate import parse_size
        assert res["limits"]["memory"].endswith("Gi")
        limit = int(res["limits"]["memory"][:-2]) * 2**30
        assert parse_size(args.kv_cache_memory) <= limit // 2, \
            "the KV cache leaves room for the model and the runtime"


def test_api_key_comes_from_the_example_secret():
    env = {e["name"]: e for e in server_container().get("env", [])}
    ref = env["KVSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    secret = load_one("secret.yaml")
    assert secret["kind"] == "Secret"
    assert ref["name"] == secret["metadata"]["name"] == "kvserve-api-key"
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    assert ref["key"] == "api-key" and ref["key"] in keys
    assert "replace" in (K8S_DIR / "secret.yaml").read_text().lower(), \
        "secret.yaml should say its value is a placeholder"


def test_grace_period_covers_prestop_and_drain():
    """The kubelet's grace period runs from the start of preStop: the sleep, then
    SIGTERM and kvserve's drain, must both end before its SIGKILL."""
    spec, c = pod_spec(), server_container()
    args = parse_serve_args([str(a) for a in c["args"]])
    assert args.shutdown_timeout == 30
    sleep = prestop_sleep_seconds(c)
    assert 0 < sleep <= 15, "a few seconds for the endpoints to drop the pod"
    assert spec["terminationGracePeriodSeconds"] == 45
    assert spec["terminationGracePeriodSeconds"] > args.shutdown_timeout + sleep


def test_security_context():
    spec, c = pod_spec(), server_container()
    pod_sc, sc = spec["securityContext"], c["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert int(pod_sc.get("runAsUser", sc.get("runAsUser", 0))) != 0
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert not sc["capabilities"].get("add")


def test_model_pvc_example():
    """Off by default (the embedded model); switched on, the first argument is a model
    directory on the kvserve-models claim, mounted read-only at /models."""
    text = (K8S_DIR / "deployment.yaml").read_text()
    assert MODEL_LINE_MARK in text, "the kvserve-models example is gone"
    assert "sed -i 's/#M //'" in text, "the comment says how to switch it on"
    default = yaml.safe_load(text)
    assert not any("persistentVolumeClaim" in v for v in pod_spec(default)["volumes"])

    dep = yaml.safe_load(uncomment_model_example(text))
    spec, c = pod_spec(dep), server_container(dep)
    claims = {v["name"]: v["persistentVolumeClaim"] for v in spec["volumes"]
              if "persistentVolumeClaim" in v}
    assert [pvc["claimName"] for pvc in claims.values()] == ["kvserve-models"]
    (name, pvc), = claims.items()
    assert pvc.get("readOnly") is True
    mount, = [m for m in c["volumeMounts"] if m["name"] == name]
    assert mount["mountPath"] == "/models" and mount.get("readOnly") is True
    args = parse_serve_args([str(a) for a in c["args"]])
    assert args.model and Path(args.model).parent == Path("/models"), args.model


# ---------------------------------------------------------------------- Service

def test_service_selects_the_deployment_pods():
    svc, dep = load_one("service.yaml"), deployment()
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels_match(svc["spec"]["selector"], pod_labels)
    port, = svc["spec"]["ports"]
    assert port["port"] == 8000 and port["name"] == "http"
    assert port["targetPort"] in named_ports(server_container(dep))


# ------------------------------------------------------------- HPA and adapter

def adapter_rules() -> list[dict]:
    cm = load_one("prometheus-adapter.yaml")
    assert cm["kind"] == "ConfigMap"
    config = yaml.safe_load(cm["data"]["config.yaml"])
    return config["rules"]


def adapter_rule_for(series: str) -> dict:
    rules = [r for r in adapter_rules() if re.match(r"\s*" + re.escape(series) + r"\s*[{]?",
                                                    r["seriesQuery"])]
    assert len(rules) == 1, f"expected one adapter rule for {series}"
    return rules[0]


def adapter_name(rule: dict, series: str) -> str:
    """The metric name the adapter gives ``series`` (its ``name.as``, with Go regexp
    ``${N}`` references)."""
    match = re.search(rule["name"]["matches"], series)
    assert match, f"{rule['name']['matches']!r} does not match {series}"
    return re.sub(r"\$\{(\d+)\}|\$(\d+)", lambda m: match.group(int(m.group(1) or m.group(2))),
                  rule["name"]["as"])


def test_adapter_rule():
    rule = adapter_rule_for(QUEUE_SERIES)
    assert rule["seriesQuery"] == QUEUE_SERIES + '{namespace!="",pod!=""}'
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                              "pod": {"resource": "pod"}}
    assert rule["name"] == {"matches": "^kvserve:(.*)$", "as": "kvserve_${1}"}
    assert rule["metricsQuery"] == "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"
    assert adapter_name(rule, QUEUE_SERIES) == "kvserve_num_requests_waiting"


def test_kvserve_exports_the_queue_series():
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.metrics import ServerMetrics
    text = ServerMetrics("m").render()[0].decode()
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert QUEUE_SERIES in samples


def test_hpa_targets_the_deployment_on_the_adapter_metric():
    hpa, dep = load_one("hpa.yaml"), deployment()
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        "apps/v1", "Deployment", dep["metadata"]["name"])
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    metric, = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert name == adapter_name(adapter_rule_for(QUEUE_SERIES), QUEUE_SERIES)
    target = metric["pods"]["target"]
    assert target["type"] == "AverageValue" and float(target["averageValue"]) > 0
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] > 0
    assert QUEUE_SERIES in (K8S_DIR / "hpa.yaml").read_text(), \
        "hpa.yaml's comment names the series the adapter renames"


# ------------------------------------------------- PodMonitor / ServiceMonitor

def test_podmonitor_scrapes_the_pods():
    pm, dep = load_one("podmonitor.yaml"), deployment()
    assert (pm["apiVersion"], pm["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels_match(pm["spec"]["selector"]["matchLabels"], pod_labels)
    endpoint, = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in named_ports(server_container(dep))
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    assert pod_labels[pm["spec"]["jobLabel"]] == "kvserve"


def test_servicemonitor_scrapes_the_service():
    sm, svc = load_one("servicemonitor.yaml"), load_one("service.yaml")
    assert (sm["apiVersion"], sm["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert labels_match(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    endpoint, = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "kvserve"


def test_scrape_job_matches_the_alert_rules():
    """deploy/prometheus/alerts.yml's EngineDown reads up{job="kvserve"}."""
    alerts = (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()
    assert 'job="kvserve"' in alerts


# --------------------------------------------------------------- kustomization

def test_kustomization_lists_existing_files():
    kust = load_one("kustomization.yaml")
    assert (kust["apiVersion"], kust["kind"]) == ("kustomize.config.k8s.io/v1beta1",
                                                  "Kustomization")
    resources = kust["resources"]
    assert len(resources) == len(set(resources)), "listed twice"
    for res in resources:
        assert (K8S_DIR / res).is_file(), f"kustomization lists missing {res}"
    assert set(resources) == {"deployment.yaml", "service.yaml", "secret.yaml", "hpa.yaml",
                              "podmonitor.yaml"}
    # every manifest is either listed or deliberately left out
    assert {p.name for p in manifest_files()} == set(resources) | NOT_IN_KUSTOMIZATION

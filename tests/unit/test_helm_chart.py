"""The Helm chart, rendered and linted by Helm itself (helm-python-sdk bundles Helm v4),
with every manifest validated against the Kubernetes API schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).parents[2] / "deploy" / "helm" / "objcache"
KUBE = "1.31.0"

CUSTOM: dict[str, Any] = {
    "bucket": "s3://imagenet/v2", "mountName": "imagenet",
    "s3": {"endpointUrl": "https://s3.example.internal", "region": "eu-de",
           "credentialsSecret": ""},
    "cache": {"hostPath": "/mnt/nvme/objcache", "size": "3T", "chunkSize": "32M",
              "nearCacheSize": "200G"},
    "cluster": {"enabled": True, "port": 7171, "secretName": "oc-key", "peerTimeout": 10},
    "metrics": {"enabled": True, "port": 9200,
                "serviceMonitor": {"enabled": True, "interval": "15s",
                                   "labels": {"release": "prom"}}},
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": "system-node-critical", "extraArgs": ["--readahead=256M"],
    "storageClass": {"create": True, "name": "objcache"},
    "staticVolumes": [{"name": "imagenet-train", "namespace": "training", "subPath": "train",
                       "readOnly": True, "capacity": "2Ti"},
                      {"name": "checkpoints", "namespace": "training"}],
    "examples": {"inlinePod": {"enabled": True, "subPath": "train"}},
    "prefetchJob": {"enabled": True, "namespace": "training", "paths": ["train", "/val"],
                    "pin": True, "jobs": 16},
}


def _render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    out = helm.Chart.load(CHART).render(values, name="oc", namespace="objcache",
                                        is_install=True)
    return [d for name, text in out.items() if not name.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]


def _validate(doc: dict[str, Any]) -> None:
    if doc["kind"] == "ServiceMonitor":  # a CRD: no schema in the Kubernetes API
        assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]["endpoints"]
        return
    kubernetes_validate.validate(doc, KUBE, strict=True)


@pytest.mark.parametrize("values", [None, CUSTOM], ids=["defaults", "custom"])
def test_chart_renders_valid_manifests_and_lints_clean(values) -> None:  # type: ignore
    docs = _render(values)
    for doc in docs:
        _validate(doc)
    kinds = sorted(d["kind"] for d in docs)
    assert {"DaemonSet", "CSIDriver", "Service", "ServiceAccount"} <= set(kinds)
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE}")
    assert not report["errors"]
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]
    if values is CUSTOM:
        assert kinds.count("PersistentVolume") == 2 and "Job" in kinds and "Pod" in kinds


def test_daemonset_wiring() -> None:
    docs = {d["kind"]: d for d in _render(CUSTOM)}
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"objcache", "csi-node", "node-driver-registrar"}
    daemon = containers["objcache"]
    args = daemon["args"]
    assert args[:2] == ["s3://imagenet/v2", "/var/lib/objcache/mounts/imagenet"]
    assert "--peers=oc-objcache-peers.objcache.svc:7171" in args
    assert "--listen=$(POD_IP):7171" in args and "--node-id=$(NODE_NAME)" in args
    assert "--endpoint-url=https://s3.example.internal" in args and "--readahead=256M" in args
    assert "--cache-size=3T" in args and "--near-cache-size=200G" in args
    assert daemon["lifecycle"]["preStop"]["exec"]["command"][:2] == ["objcache", "umount"]
    assert pod["terminationGracePeriodSeconds"] == 600
    mounts = {m["name"]: m for m in daemon["volumeMounts"]}
    assert mounts["mounts"]["mountPropagation"] == "Bidirectional"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert docs["CSIDriver"]["spec"]["attachRequired"] is False
    assert docs["CSIDriver"]["spec"]["volumeLifecycleModes"] == ["Persistent", "Ephemeral"]
    assert docs["Service"]["spec"]["clusterIP"] == "None"
    job = docs["Job"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert job[-3:] == ["--pin", "/data/train", "/data/val"]
    # No S3 credential secret given: the pod relies on its own identity.
    assert not [e for e in daemon["env"] if e["name"].startswith("AWS_")]


@pytest.mark.parametrize("bad", [
    {"bucket": "datasets"},                        # not s3://
    {"cache": {"hostPath": "/x", "size": "lots"}},  # not a size
    {"cluster": {"port": 70000}},
    {"logLevel": "verbose"},
    {"terminationGracePeriodSeconds": 5},          # too short to upload dirty data
    {"unknownKey": 1},
    {"staticVolumes": [{"subPath": "x"}]},         # a PV needs a name
])
def test_schema_rejects_bad_values(bad) -> None:  # type: ignore
    chart = helm.Chart.load(CHART)
    with pytest.raises(helm.HelmError):
        chart.render(bad, name="oc", namespace="objcache")

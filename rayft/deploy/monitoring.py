"""What a Prometheus Operator + Grafana stack needs to chart a rayft run on KubeRay: a PodMonitor that scrapes the
metrics port of the head and every worker pod, and rayft's dashboard in a ConfigMap that Grafana's dashboard
sidecar (kube-prometheus-stack, the Grafana chart) loads by its label.

No CRD of monitoring.coreos.com is vendored, so the PodMonitor is checked against the few fields rayft writes, as
the operator's CRD defines them (spec.selector a label selector, podMetricsEndpoints with a named port).
"""

from __future__ import annotations

from typing import Any

from rayft.kube.apirules import METADATA_SCHEMA, STRING_MAP, manifest_schema

METRICS_PORT_NAME = "metrics"  # the container port name on head and workers (Ray's --metrics-export-port 8080)
METRICS_PORT = 8080
DASHBOARD_LABEL = {"grafana_dashboard": "1"}  # the Grafana sidecar's default label
DASHBOARD_KEY = "rayft-dashboard.json"

SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): manifest_schema(
        {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {"matchLabels": {**STRING_MAP, "minProperties": 1}},
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string", "minLength": 1},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {"type": "array", "items": {"type": "string"}},
                                        "targetLabel": {"type": "string"},
                                        "action": {"enum": ["replace", "keep", "drop", "labelmap"]},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        }
    ),
    ("v1", "ConfigMap"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "data"],
        "properties": {"metadata": METADATA_SCHEMA, "data": {**STRING_MAP, "minProperties": 1}},
    },
}


def pod_monitor(name: str, namespace: str, pod_labels: dict[str, str], interval: str = "15s") -> dict[str, Any]:
    """One PodMonitor for head and workers: both carry rayft's pod labels and Ray's metrics port. KubeRay's
    `ray.io/node-type` and `ray.io/cluster` pod labels become series labels, as in KubeRay's own monitors."""
    relabel = [
        {"sourceLabels": [f"__meta_kubernetes_pod_label_{label}"], "targetLabel": label}
        for label in ("ray_io_cluster", "ray_io_node_type")
    ]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": f"{name}-ray", "namespace": namespace, "labels": dict(pod_labels)},
        "spec": {
            "jobLabel": "ray",
            "namespaceSelector": {"matchNames": [namespace]},
            "selector": {"matchLabels": dict(pod_labels)},
            "podMetricsEndpoints": [
                {"port": METRICS_PORT_NAME, "path": "/metrics", "interval": interval, "relabelings": relabel}
            ],
        },
    }


def dashboard_config_map(name: str, namespace: str, labels: dict[str, str], dashboard_json: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{name}-grafana-dashboard",
            "namespace": namespace,
            "labels": {**labels, **DASHBOARD_LABEL},
        },
        "data": {DASHBOARD_KEY: dashboard_json},
    }

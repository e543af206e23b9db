"""Who may reach a run's pods (`k8s.network_policy`): a NetworkPolicy over the head, the workers and the submitter.

A Ray head runs whatever code reaches its job API (the dashboard port), its GCS or its client port. Token
authentication refuses a request without the token; the policy narrows who can send one at all: the run's own pods,
which talk to each other on many ports Ray picks (GCS, raylets, object store, workers, NCCL's bootstrap), and,
on the dashboard port alone, the KubeRay operator (which follows a RayJob through the head's job API) and the pods
`k8s.network_policy_admits` names (a CI runner that submits jobs, a UI), in any namespace. With monitoring on,
Prometheus may scrape the metrics port from any namespace. `kubectl port-forward` enters a pod through its node,
which such policies leave alone on the common network plugins.

Core Kubernetes kinds have no CRD to check against, so the fields written here are checked against a schema of
them, as the networking.k8s.io/v1 API defines them.
"""

from __future__ import annotations

from typing import Any

from rayft.deploy.monitoring import METRICS_PORT
from rayft.kube.apirules import STRING_MAP, manifest_schema

DASHBOARD_PORT = 8265  # the head's dashboard and job API
OPERATOR = {"app.kubernetes.io/name": "kuberay-operator"}  # the KubeRay operator's pods, as its Helm chart labels them

_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {"matchLabels": STRING_MAP}}
_PEER = {
    "type": "object",
    "minProperties": 1,
    "additionalProperties": False,
    "properties": {"podSelector": _SELECTOR, "namespaceSelector": _SELECTOR},
}
_PORT = {
    "type": "object",
    "required": ["port"],
    "additionalProperties": False,
    "properties": {"port": {"type": "integer", "minimum": 1, "maximum": 65535}, "protocol": {"enum": ["TCP", "UDP"]}},
}
SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("networking.k8s.io/v1", "NetworkPolicy"): manifest_schema(
        {
            "type": "object",
            "required": ["podSelector", "policyTypes", "ingress"],
            "additionalProperties": False,
            "properties": {
                "podSelector": {**_SELECTOR, "required": ["matchLabels"]},
                "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
                "ingress": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["from"],
                        "additionalProperties": False,
                        "properties": {
                            "from": {"type": "array", "minItems": 1, "items": _PEER},
                            "ports": {"type": "array", "minItems": 1, "items": _PORT},
                        },
                    },
                },
            },
        }
    )
}


def network_policy(
    metadata: dict[str, Any], run_labels: dict[str, str], admits: dict[str, str], metrics: bool
) -> dict[str, Any]:
    """The policy over the pods carrying `run_labels` (this run's): every port from those pods; the dashboard port
    from the KubeRay operator and the pods labelled `admits`, in any namespace; the metrics port from anywhere where
    `metrics`."""
    own = {"podSelector": {"matchLabels": dict(run_labels)}}
    ingress: list[dict[str, Any]] = [{"from": [own]}]
    peers = [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(labels)}} for labels in (OPERATOR, admits)]
    ingress.append({"from": [p for p in peers if p["podSelector"]["matchLabels"]], "ports": [_tcp(DASHBOARD_PORT)]})
    if metrics:
        ingress.append({"from": [{"namespaceSelector": {}}], "ports": [_tcp(METRICS_PORT)]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {"podSelector": {"matchLabels": dict(run_labels)}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _tcp(port: int) -> dict[str, Any]:
    return {"port": port, "protocol": "TCP"}

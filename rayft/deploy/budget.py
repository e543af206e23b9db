"""A PodDisruptionBudget for the run's head pod: the head holds the job's driver and Ray's control store, so a
voluntary eviction of it (a node drained for maintenance or a scale-down) would end the run, where a GPU worker's
costs a checkpoint and a restart. Kubernetes' eviction API then refuses to evict the head while the run lives
(`kubectl drain` waits, or is told to skip the pod); an involuntary loss (a reclaimed spot node) is not stopped by
any budget, which is why the head belongs on on-demand capacity.

Core Kubernetes kinds have no CRD to check against, so the fields written here are checked against a schema of
them, as the policy/v1 API defines them.
"""

from __future__ import annotations

from typing import Any

from rayft.kube.apirules import STRING_MAP, manifest_schema

HEAD_SELECTOR = {"ray.io/node-type": "head"}  # KubeRay's label on every head pod

SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("policy/v1", "PodDisruptionBudget"): manifest_schema(
        {
            "type": "object",
            "required": ["selector"],
            "additionalProperties": False,
            "properties": {
                "maxUnavailable": {"type": ["integer", "string"]},
                "minAvailable": {"type": ["integer", "string"]},
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {"matchLabels": {**STRING_MAP, "minProperties": 1}},
                },
                "unhealthyPodEvictionPolicy": {"enum": ["IfHealthyBudget", "AlwaysAllow"]},
            },
            "not": {"required": ["maxUnavailable", "minAvailable"]},
        }
    )
}


def head_budget(metadata: dict[str, Any], pod_labels: dict[str, str]) -> dict[str, Any]:
    """The budget of the head pod that carries `pod_labels` (the run's own labels, so no other run's head is held):
    none of it may be evicted voluntarily; a head that is not running (crash-looping) may still be."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {
            "maxUnavailable": 0,
            "selector": {"matchLabels": {**pod_labels, **HEAD_SELECTOR}},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }

"""The start watcher's manifests, for operators without `spec.preRunningDeadlineSeconds` (KubeRay 1.4, 1.5): a Job of
one small CPU pod running `rayft.deploy.start_watch` in the run's image, its ServiceAccount, and a Role, bound to
it, that may read and patch this one RayJob and nothing else.

The Job outlives the watch by a margin (its pod's own scheduling and image pull) and is then stopped by its active
deadline whatever happens, so a watcher that can never reach the API holds nothing for long. Under Kueue the
deadline counts from admission, which may come hours later, so the Job's bound is the RayJob's own active deadline
on top. The Job carries no queue label (Kueue, Volcano): a queue would hold the watcher back while the RayJob waits.

Core Kubernetes kinds have no CRD to check against, so the fields written here are checked against a schema of
them, as the batch/v1, v1 and rbac.authorization.k8s.io/v1 APIs define them.
"""

from __future__ import annotations

from typing import Any

from rayft.deploy import platform
from rayft.kube.apirules import METADATA_SCHEMA, STRING_MAP, manifest_schema
from rayft.kube.settings import K8sConfig

MODULE = "rayft.deploy.start_watch"
SUFFIX = "-start-watch"  # the Job's, the ServiceAccount's, the Role's and the RoleBinding's name after the RayJob's
MARGIN_S = 600  # beyond the deadline: the watcher pod's own scheduling and image pull, and a last poll
RESOURCES = {"cpu": "100m", "memory": "128Mi"}
RBAC = "rbac.authorization.k8s.io"
VERBS = ["get", "patch"]  # read the RayJob's status; lower its active deadline

_STRINGS = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}
_POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "metadata": {"type": "object", "properties": {"labels": STRING_MAP, "annotations": STRING_MAP}},
        "spec": {
            "type": "object",
            "required": ["containers", "restartPolicy", "serviceAccountName"],
            "properties": {
                "restartPolicy": {"enum": ["Never", "OnFailure"]},  # what a Job's pod may have
                "serviceAccountName": {"type": "string", "minLength": 1},
                "containers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "object", "required": ["name", "image"]},
                },
            },
        },
    },
}
_ROLE_NAME = {"type": "string", "minLength": 1}
SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("batch/v1", "Job"): manifest_schema(
        {
            "type": "object",
            "required": ["template"],
            "additionalProperties": False,
            "properties": {
                "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "backoffLimit": {"type": "integer", "minimum": 0},
                "template": _POD_TEMPLATE,
            },
        }
    ),
    ("v1", "ServiceAccount"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata"],
        "properties": {"metadata": METADATA_SCHEMA},
    },
    (f"{RBAC}/v1", "Role"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "rules"],
        "properties": {
            "metadata": METADATA_SCHEMA,
            "rules": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["apiGroups", "resources", "verbs"],
                    "additionalProperties": False,
                    "properties": {
                        "apiGroups": {"type": "array", "items": {"type": "string"}},
                        "resources": _STRINGS,
                        "resourceNames": _STRINGS,
                        "verbs": _STRINGS,
                    },
                },
            },
        },
    },
    (f"{RBAC}/v1", "RoleBinding"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "roleRef", "subjects"],
        "properties": {
            "metadata": METADATA_SCHEMA,
            "roleRef": {
                "type": "object",
                "required": ["apiGroup", "kind", "name"],
                "additionalProperties": False,
                "properties": {
                    "apiGroup": {"const": RBAC},
                    "kind": {"enum": ["Role", "ClusterRole"]},
                    "name": _ROLE_NAME,
                },
            },
            "subjects": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["kind", "name"],
                    "additionalProperties": False,
                    "properties": {"kind": {"const": "ServiceAccount"}, "name": _ROLE_NAME, "namespace": _ROLE_NAME},
                },
            },
        },
    },
}


def manifests(
    rayjob: str,
    metadata: dict[str, Any],
    pod_labels: dict[str, str],
    image: str,
    deadlines: tuple[int, int, int],
    plat: K8sConfig,
) -> dict[str, dict[str, Any]]:
    """{"start-watch-account", "start-watch-role", "start-watch-binding", "start-watch"} for the RayJob named
    `rayjob`; `metadata` (namespace, labels, annotations) is each object's but its name; `deadlines` the
    pre-running deadline, the RayJob's active deadline and the TTL after finishing, in seconds."""
    name, namespace = f"{rayjob}{SUFFIX}", metadata["namespace"]
    meta = {**metadata, "name": name}
    rule = {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "resourceNames": [rayjob], "verbs": list(VERBS)}
    return {
        "start-watch-account": {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        "start-watch-role": {"apiVersion": f"{RBAC}/v1", "kind": "Role", "metadata": dict(meta), "rules": [rule]},
        "start-watch-binding": {
            "apiVersion": f"{RBAC}/v1",
            "kind": "RoleBinding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
        "start-watch": job(rayjob, meta, pod_labels, image, deadlines, plat),
    }


def job(
    rayjob: str,
    meta: dict[str, Any],
    pod_labels: dict[str, str],
    image: str,
    deadlines: tuple[int, int, int],
    plat: K8sConfig,
) -> dict[str, Any]:
    """The watcher's Job: the platform's settings for every pod laid on its pod as on the submitter's (labels,
    tolerations, pull secrets, security context), but its own ServiceAccount and no credentials in its environment."""
    pre_running, active, ttl = deadlines
    args = ["--name", rayjob, "--namespace", meta["namespace"], "--deadline-s", str(pre_running)]
    container = {
        "name": "start-watch",
        "image": image,
        "command": ["python", "-m", MODULE],
        "args": args,
        "resources": {"requests": dict(RESOURCES), "limits": dict(RESOURCES)},
    }
    template: dict[str, Any] = {
        "metadata": {"labels": {**pod_labels, "rayft.io/role": "start-watch"}},
        "spec": {"restartPolicy": "Never", "containers": [container]},
    }
    platform.apply_to_pod(template, plat, "watcher")
    template["spec"]["serviceAccountName"] = meta["name"]
    queued = plat.queueing == "kueue"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "activeDeadlineSeconds": pre_running + MARGIN_S + (active if queued else 0),
            "ttlSecondsAfterFinished": ttl,
            "backoffLimit": 2,  # a watcher pod lost with its node starts again; its deadline is the RayJob's
            "template": template,
        },
    }

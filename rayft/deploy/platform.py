"""How a platform's requirements (the config's `k8s` section, `rayft.kube.settings`) are laid onto rendered KubeRay
manifests: queues, schedulers, placement, security, the RDMA fabric and the nodes' shape.

Kept apart from the renderer (which derives pods from the training config) because these settings come from the
cluster's owners, not from the run: the same labels, tolerations and security context on every pod KubeRay
creates, the head's, the GPU workers' and the submitter's, so that a policy admitting one admits them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rayft.kube import credentials
from rayft.kube.settings import K8sConfig
from rayft.schema import (
    ConfigError,
    checked,
)

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# KubeRay's batch-scheduler integration reads this label on the RayCluster / RayJob (operator flag
# --enable-batch-scheduler or batchScheduler.name=volcano), then sets the pods' schedulerName itself.
KUBERAY_SCHEDULER_LABEL = "ray.io/scheduler-name"
VOLCANO_QUEUE_LABEL = "volcano.sh/queue-name"
RUNAI_SCHEDULER = "runai-scheduler"
RUNAI_QUEUE_LABEL = "runai/queue"
# KubeRay's default submitter asks for this much; ours keeps it so the submitter fits the same quotas.
SUBMITTER_RESOURCES = {"cpu": "1", "memory": "1Gi"}


def with_flags(base: K8sConfig, flags: Mapping[str, Any], where: Mapping[str, str] | None = None) -> K8sConfig:
    """The config's `k8s:` section with `rayft k8s render` flags (by dotted key, `rdma.network`) on top: scalars
    replace, mappings and lists add; checked as the section is (`where`: the flag that sets a key)."""
    values = dataclasses.asdict(base)
    for key, value in flags.items():
        *path, last = key.split(".")
        node = values
        for part in path:
            node = node[part]
        current = node[last]
        if isinstance(current, dict):
            node[last] = {**current, **value}
        elif isinstance(current, list):
            node[last] = [*current, *value]
        else:
            node[last] = value
    return checked("k8s", K8sConfig, values, where)


def key_values(flag: str, items: list[str]) -> dict[str, str]:
    """`KEY=VALUE` flag values as a mapping (a clear error naming the flag otherwise)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} '{item}': expected KEY=VALUE")
        out[key] = value
    return out


def toleration(item: str) -> dict[str, str]:
    """`KEY[=VALUE][:EFFECT]`, kubectl taint's spelling, as a Toleration (Exists without a value)."""
    spec, _, effect = item.partition(":")
    key, sep, value = spec.partition("=")
    if not key:
        raise ConfigError(f"--toleration '{item}': expected KEY[=VALUE][:EFFECT], e.g. gpu-pool=a100:NoSchedule")
    out = {"key": key, "operator": "Equal" if sep else "Exists"}
    if sep:
        out["value"] = value
    if effect:
        if effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ConfigError(f"--toleration '{item}': effect must be NoSchedule, PreferNoSchedule or NoExecute")
        out["effect"] = effect
    return out


def hf_env(p: K8sConfig, mount_path: str) -> dict[str, str]:
    """The Hugging Face cache every Ray pod shares (on the PVC unless `k8s.hf_home` says where), and offline mode
    where the cluster cannot, or must not, reach the hub: hub names then resolve from that cache only."""
    env = {"HF_HOME": p.hf_home or f"{mount_path}/hf-cache"}
    return {**env, "HF_HUB_OFFLINE": "1"} if p.hf_offline else env


def scheduler_name(p: K8sConfig) -> str | None:
    """The pods' schedulerName rayft sets (Volcano's is set by the operator from the label)."""
    return p.scheduler_name or (RUNAI_SCHEDULER if p.queueing == "runai" else None)


def object_labels(p: K8sConfig) -> dict[str, str]:
    """Labels on the RayJob / RayCluster objects, where Kueue and KubeRay's batch schedulers read the queue."""
    if p.queueing == "kueue":
        return {KUEUE_QUEUE_LABEL: p.queue or ""}
    if p.queueing == "volcano":
        return {KUBERAY_SCHEDULER_LABEL: "volcano", VOLCANO_QUEUE_LABEL: p.queue or ""}
    return {}


def pod_labels(p: K8sConfig) -> dict[str, str]:
    return {**p.labels, **({RUNAI_QUEUE_LABEL: p.queue or ""} if p.queueing == "runai" else {})}


def pod_security_context(p: K8sConfig) -> dict[str, Any]:
    """The pods' securityContext. With an fsGroup, the kubelet changes the group of every file on each volume at
    every pod start unless told to do so only where the volume's root differs: on a shared PVC of checkpoints and
    models that is minutes per pod, so OnRootMismatch."""
    given = {
        "runAsUser": p.run_as_user,
        "runAsGroup": p.run_as_group,
        "fsGroup": p.fs_group,
        "fsGroupChangePolicy": "OnRootMismatch" if p.fs_group is not None else None,
        "runAsNonRoot": p.run_as_non_root,
    }
    return {k: v for k, v in given.items() if v is not None}


def apply_to_pod(template: dict[str, Any], p: K8sConfig, role: str) -> None:
    """Lay the platform's settings onto one pod template; `role` is head, worker, submitter or watcher (the start
    watcher: as the submitter, but its own ServiceAccount and no environment, so no credential reaches it)."""
    meta = template.setdefault("metadata", {})
    labels = pod_labels(p)
    if labels:
        meta["labels"] = {**meta.get("labels", {}), **labels}
    if p.annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **p.annotations}
    spec = template["spec"]
    if p.tolerations:  # the platform's, beside rayft's GPU one, each once
        given = [*spec.get("tolerations", []), *p.tolerations]
        spec["tolerations"] = [t for i, t in enumerate(given) if t not in given[:i]]
    selector = p.node_selector if role == "worker" else p.head_node_selector if role == "head" else {}
    if selector:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **selector}
    if role == "worker" and p.affinity:
        spec["affinity"] = merge_affinity(spec.get("affinity", {}), p.affinity)
    for key, value in (
        ("priorityClassName", p.priority_class_name),
        ("serviceAccountName", p.service_account_name if role != "watcher" else None),
        ("schedulerName", scheduler_name(p)),
    ):
        if value:
            spec[key] = value
    if p.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in p.image_pull_secrets]
    security = pod_security_context(p)
    if security:
        spec["securityContext"] = {**spec.get("securityContext", {}), **security}
    container = spec["containers"][0]  # the Ray container (the submitter's only one)
    if role == "watcher":
        return
    if p.env:
        container["env"] = [*container.get("env", []), *({"name": k, "value": v} for k, v in p.env.items())]
    if p.secret_env:
        container["env"] = [*container.get("env", []), *credentials.env_from_secrets(p.secret_env)]
    if role != "submitter" and p.volumes:
        spec["volumes"] = [*spec.get("volumes", []), *p.volumes]
        container["volumeMounts"] = [*container.get("volumeMounts", []), *p.volume_mounts]


def merge_affinity(ours: dict[str, Any], added: dict[str, Any]) -> dict[str, Any]:
    """The user's affinity beside rayft's: term lists are appended, so rayft's one-GPU-pod-per-node stays."""
    out = {kind: {**rules} for kind, rules in ours.items()}
    for kind, rules in added.items():
        target = out.setdefault(kind, {})
        for when, terms in rules.items():
            if when == "requiredDuringSchedulingIgnoredDuringExecution" and kind == "nodeAffinity":
                have = target.get(when, {}).get("nodeSelectorTerms", [])
                target[when] = {"nodeSelectorTerms": [*have, *terms.get("nodeSelectorTerms", [])]}
            else:
                target[when] = [*target.get(when, []), *terms]
    return out


def submitter_template(image: str, labels: dict[str, str], p: K8sConfig) -> dict[str, Any]:
    """The pod that runs `ray job submit`: KubeRay fills in its command and the dashboard address when the
    container has none, so only what the platform needs is given (rayft's labels, so `-l rayft.io/job=` finds it)."""
    template = {
        "metadata": {"labels": dict(labels)},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "ray-job-submitter",
                    "image": image,
                    "resources": {"requests": dict(SUBMITTER_RESOURCES), "limits": dict(SUBMITTER_RESOURCES)},
                }
            ],
        },
    }
    apply_to_pod(template, p, "submitter")
    return template

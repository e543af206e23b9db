"""How the GPU worker pods fill the declared nodes: a pod holds `ray.workers_per_node` GPUs (the pod is the node its
workers share, to Ray and to the meshes) and the node's CPUs and memory in proportion to them, so pods of any size
tile a node. A render whose pods could not all be scheduled is refused with the arithmetic, instead of leaving
pods Pending with no word of why.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rayft.config import ConfigError, RayConfig
from rayft.kube.apirules import memory_quantity, quantity_bytes
from rayft.kube.settings import NodeShape


@dataclass(frozen=True)
class WorkerPods:
    """The GPU worker group: `pods` pods of `gpus` GPUs, `cpus` CPUs and `memory` bytes each, at most `per_node`
    of them on one node; an elastic run goes on with as few as `fewest` of them."""

    pods: int
    gpus: int
    cpus: int
    memory: int
    per_node: int
    fewest: int

    @property
    def memory_quantity(self) -> str:
        return memory_quantity(self.memory)


def worker_pods(
    ray: RayConfig,
    node: NodeShape,
    one_pod_per_node: bool,
    gpus_per_pod: int | None = None,
    cpus: int | None = None,
    memory: str | None = None,
) -> WorkerPods:
    """The worker pods of this run on nodes of this shape; `gpus_per_pod`, `cpus` and `memory` are the render flags
    (None: from the config and the node's share per GPU). ConfigError naming each problem with its arithmetic."""
    gpus = gpus_per_pod or ray.workers_per_node
    problems = _grouping_problems(ray, gpus)
    if gpus > node.gpus:
        problems.append(
            f"ray.workers_per_node: a worker pod of {gpus} GPUs does not fit a node of {node.gpus} "
            f"(k8s.node.gpus); set ray.workers_per_node to at most {node.gpus}, or declare the nodes' "
            "GPUs in k8s.node.gpus"
        )
    if problems:
        raise ConfigError("\n".join(problems))
    node_memory = quantity_bytes(node.memory)
    pod = WorkerPods(
        pods=ray.num_workers // gpus,
        fewest=ray.fewest_workers // gpus,
        gpus=gpus,
        cpus=cpus if cpus is not None else node.cpus * gpus // node.gpus,
        memory=quantity_bytes(memory) if memory is not None else node_memory * gpus // node.gpus,
        per_node=1,
    )
    fits = {
        "its GPUs": node.gpus // gpus,
        "its CPUs": node.cpus // max(pod.cpus, 1),
        "its memory": node_memory // pod.memory,
    }
    if one_pod_per_node:
        fits["k8s.one_pod_per_node"] = 1
    if min(fits.values()) < 1:
        raise ConfigError(
            f"--worker-cpus / --worker-memory: a worker pod asks for {pod.cpus} CPUs and {pod.memory_quantity}, more "
            f"than a node has ({node.cpus} CPUs and {node.memory}: k8s.node.cpus, k8s.node.memory); lower them, or "
            "declare the nodes' shape"
        )
    pod = dataclasses.replace(pod, per_node=min(fits.values()))
    _check_count(pod, node, fits, ray)
    return pod


def _grouping_problems(ray: RayConfig, gpus: int) -> list[str]:
    """Whole pods of whole nodes' workers: `ray.num_workers` = pods × GPUs a pod, and a pod = a Ray node."""
    problems = []
    if gpus < 1:
        problems.append(f"--gpus-per-pod: must be at least 1, got {gpus}")
    elif ray.num_workers % gpus:
        problems.append(
            f"GPU count mismatch: ray.num_workers={ray.num_workers} is not a whole number of pods of "
            f"{gpus} GPUs; make ray.num_workers a multiple of ray.workers_per_node"
        )
    if gpus >= 1 and ray.workers_per_node != gpus:
        # The pod is the node: its workers must be one node to the meshes (HSDP, expert-parallel groups) too.
        problems.append(
            f"ray.workers_per_node: {ray.workers_per_node}, but --gpus-per-pod={gpus} puts {gpus} "
            f"workers on each pod; set ray.workers_per_node: {gpus}"
        )
    return problems


def _check_count(pod: WorkerPods, node: NodeShape, fits: dict[str, int], ray: RayConfig) -> None:
    """Refuses pods that `k8s.node.count` nodes cannot hold, showing what limits a node and the way out."""
    if node.count is None or pod.pods <= node.count * pod.per_node:
        return
    limit = min(fits, key=fits.__getitem__)
    needed = math.ceil(pod.pods / pod.per_node)
    fix = f"set ray.workers_per_node: {node.gpus}" if pod.gpus < node.gpus else "lower ray.num_workers"
    if limit == "k8s.one_pod_per_node":
        fix += " or k8s.one_pod_per_node: false"
    raise ConfigError(
        f"k8s.node.count: {pod.pods} worker pods ({ray.num_workers} workers, {pod.gpus} a pod) at {pod.per_node} a "
        f"node (limited by {limit}) need {needed} nodes, but {node.count} are declared: "
        f"{pod.pods - node.count * pod.per_node} pods would stay Pending; {fix}, or declare more nodes"
    )


def placement_notes(pod: WorkerPods, node: NodeShape) -> list[str]:
    """What the render leaves unused on each node, for the user to read beside the manifests."""
    idle = node.gpus - pod.per_node * pod.gpus
    if idle <= 0 or pod.pods < 1:
        return []
    pods = f"{pod.per_node} worker pod{'s' if pod.per_node > 1 else ''} of {pod.gpus} GPU{'s' if pod.gpus > 1 else ''}"
    return [
        f"a node holding {pods} keeps {idle} of its {node.gpus} GPUs (k8s.node.gpus) free for other pods; "
        "ray.workers_per_node and k8s.one_pod_per_node decide how many a node takes"
    ]

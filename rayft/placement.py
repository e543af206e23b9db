"""Where the workers go: GPU or CPU (and which GPU) from the cluster's resources, and whether the workers'
placement group can ever fit the cluster (now, once nodes join, or at its autoscaler's maximum), refused before Ray
Train would cycle between scheduling and rescheduling forever."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import ray

from rayft import ray_private
from rayft.config import ConfigError, RayConfig
from rayft.gpus import gpu_named

log = logging.getLogger("rayft")


def resolve_use_gpu(ray_cfg: RayConfig) -> bool:
    gpus: float = ray.cluster_resources().get("GPU", 0)  # type: ignore[no-untyped-call]  # unannotated in Ray 2.60
    if ray_cfg.use_gpu is None:
        return gpus > 0
    if ray_cfg.use_gpu and gpus == 0:
        raise ConfigError("ray.use_gpu: true but the Ray cluster has no GPUs; set ray.use_gpu: false to train on CPU")
    return ray_cfg.use_gpu


def wait_for_placement(ray_cfg: RayConfig, bundle: dict[str, float], started_locally: bool) -> None:
    """Before fit(): the workers' placement group must fit the cluster, or Ray Train cycles between scheduling
    and rescheduling forever. A cluster that cannot ever fit it is refused at once: the local one, or one whose
    autoscaler's declared maximum is too small. Otherwise (nodes may still join) this waits, at most
    `ray.placement_timeout_s`, saying what for; Ctrl-C stops the wait."""
    request = Request(ray_cfg.fewest_workers, bundle, ray_cfg.ray_placement_strategy(), ray_cfg.workers_per_node)
    nodes = node_totals()
    if request.fits(nodes):
        return
    ceiling = autoscaler_ceiling()
    if started_locally or (ceiling is not None and not request.fits(ceiling)):
        raise ConfigError(
            request.refusal(
                nodes, "the local Ray cluster" if started_locally else "this cluster, even at its autoscaler's maximum,"
            )
        )
    deadline = time.monotonic() + ray_cfg.placement_timeout_s
    log.warning(
        "waiting up to %ds (ray.placement_timeout_s) for the cluster to fit %s; it offers %s now",
        ray_cfg.placement_timeout_s,
        request.describe(),
        describe_nodes(nodes),
    )
    while time.monotonic() < deadline:
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        nodes = node_totals()
        if request.fits(nodes):
            log.info("the cluster now fits %s", request.describe())
            return
    raise ConfigError(request.refusal(nodes, f"the cluster (after waiting {ray_cfg.placement_timeout_s}s)"))


@dataclass(frozen=True)
class Request:
    """The workers' placement group: `workers` bundles of `bundle`, placed by a Ray placement strategy;
    `per_node` > 1: exactly that many on each node they use (`ray.workers_per_node`)."""

    workers: int
    bundle: dict[str, float]
    strategy: str
    per_node: int = 1

    def fits(self, nodes: list[dict[str, float]]) -> bool:
        """Whether some placement exists on nodes with these resource totals."""
        per_node = [self._bundles_on(node) for node in nodes]
        if self.per_node > 1:  # whole groups: nodes that each hold a node's workers
            return sum(1 for n in per_node if n >= self.per_node) >= self.workers // self.per_node
        if self.strategy == "STRICT_PACK":
            return any(n >= self.workers for n in per_node)
        if self.strategy == "STRICT_SPREAD":
            return sum(1 for n in per_node if n >= 1) >= self.workers
        return sum(per_node) >= self.workers  # PACK, SPREAD: bundles go wherever they fit

    def _bundles_on(self, node: dict[str, float]) -> int:
        counts = [math.floor(node.get(r, 0) / amount) for r, amount in self.bundle.items() if amount > 0]
        return min(counts) if counts else self.workers  # an empty bundle fits anywhere

    def describe(self) -> str:
        each = ", ".join(f"{r} {_amount(a)}" for r, a in sorted(self.bundle.items()))
        total = ", ".join(f"{r} {_amount(a * self.workers)}" for r, a in sorted(self.bundle.items()))
        grouped = f", {self.per_node} on each of {self.workers // self.per_node} nodes" if self.per_node > 1 else ""
        return f"{self.workers} workers × {{{each}}} = {{{total}}} ({self.strategy}{grouped})"

    def refusal(self, nodes: list[dict[str, float]], where: str) -> str:
        if self.per_node > 1 and Request(self.workers, self.bundle, "PACK").fits(nodes):
            return (
                f"ray.workers_per_node: {where} cannot place {self.describe()}: it offers {describe_nodes(nodes)}, "
                f"and fewer than {self.workers // self.per_node} of its nodes hold {self.per_node} workers each; "
                "lower ray.workers_per_node or ray.resources_per_worker, or add nodes"
            )
        if self.strategy == "STRICT_SPREAD" and Request(self.workers, self.bundle, "PACK").fits(nodes):
            return (
                f"ray.placement_strategy: STRICT_SPREAD puts each of the {self.workers} workers on its own node, but "
                f"{where} offers {describe_nodes(nodes)}; set ray.placement_strategy: PACK to share nodes, or add "
                "nodes"
            )
        return (
            f"ray.num_workers: {where} cannot place {self.describe()}: it offers {describe_nodes(nodes)}; lower "
            "ray.num_workers or ray.resources_per_worker, change ray.placement_strategy, or add nodes"
        )


UNBOUNDED_NODES = 100_000


def node_totals() -> list[dict[str, float]]:
    """Each live node's total resources (what it can ever offer, not what is free now)."""
    # ray.nodes is unannotated in Ray 2.60
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]


def autoscaler_ceiling() -> list[dict[str, float]] | None:
    """The largest cluster the autoscaler may build (its node groups × their max counts; an unbounded group as
    more nodes than any job asks for), or None when no autoscaler declared its configuration (a fixed cluster)."""
    state = ray_private.cluster_state()
    if state is None:
        return None
    try:
        config = state.get_cluster_config()
    except Exception:  # a private API: its failure means we cannot tell, not an error of the user's
        return None
    if config is None or not config.node_group_configs:
        return None
    nodes: list[dict[str, float]] = []
    for group in config.node_group_configs:
        nodes += [dict(group.resources)] * (UNBOUNDED_NODES if group.max_count < 0 else group.max_count)
    return nodes


def describe_nodes(nodes: list[dict[str, float]]) -> str:
    """Totals, then the first nodes one by one: what a refusal shows next to what was asked for."""
    shown = ["{" + ", ".join(f"{k} {_amount(n[k])}" for k in ("CPU", "GPU") if k in n) + "}" for n in nodes[:8]]
    more = f" and {len(nodes) - 8} more" if len(nodes) > 8 else ""
    cpus, gpus = (sum(n.get(k, 0) for n in nodes) for k in ("CPU", "GPU"))
    return f"CPU {_amount(cpus)}, GPU {_amount(gpus)} in total on {len(nodes)} node(s) ({', '.join(shown)}{more})"


def _amount(value: float) -> str:
    return f"{value:g}"


def cluster_gpu(use_gpu: bool) -> str | None:
    """The GPU the workers train on, by the `accelerator_type:` resource Ray gives each GPU node (a name of
    rayft.gpus.GPUS); None on CPU workers, a GPU the planner does not know, or a cluster of several kinds."""
    if not use_gpu:
        return None
    return gpu_of(ray.cluster_resources())  # type: ignore[no-untyped-call]  # unannotated in Ray 2.60


def gpu_of(resources: dict[str, float]) -> str | None:
    """The one GPU kind a cluster's resources name (`accelerator_type:H200`), as rayft.gpus names it; None for
    none, several, or one the planner does not know."""
    kinds = {gpu_named(key.split(":", 1)[1]) for key in resources if key.startswith("accelerator_type:")}
    return kinds.pop() if len(kinds) == 1 else None

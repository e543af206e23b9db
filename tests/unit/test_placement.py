"""Whether a worker group fits a cluster's nodes (rayft.placement.Request), for each placement strategy: the
answers worked out by hand."""

from __future__ import annotations

import pytest

NODE = {"CPU": 4.0, "memory": 8e9}
GPU_NODE = {"CPU": 16.0, "GPU": 8.0}
PLACEMENT = [  # (workers, bundle, strategy, nodes, fits) — worked out by hand
    (8, {"CPU": 1}, "PACK", [NODE, NODE], True),
    (12, {"CPU": 1}, "PACK", [NODE, NODE], False),
    (3, {"CPU": 3}, "SPREAD", [NODE, NODE], False),  # 4 CPUs hold one 3-CPU bundle each: 2 in all
    (4, {"CPU": 2}, "STRICT_PACK", [NODE, NODE], False),
    (2, {"CPU": 2}, "STRICT_PACK", [NODE, NODE], True),
    (2, {"CPU": 1}, "STRICT_SPREAD", [NODE], False),
    (2, {"CPU": 1}, "STRICT_SPREAD", [NODE, NODE], True),
    (16, {"GPU": 1}, "PACK", [GPU_NODE, GPU_NODE], True),
    (3, {"GPU": 1}, "STRICT_SPREAD", [GPU_NODE, GPU_NODE], False),
    (1, {"GPU": 1}, "PACK", [NODE], False),
    (9, {"CPU": 1, "GPU": 1}, "PACK", [NODE, GPU_NODE], False),  # only the GPU node holds these: 8
]
PER_NODE = [  # (workers, bundle, workers per node, nodes, key a refusal names): whole groups on nodes that hold them
    (16, {"GPU": 1}, 8, [GPU_NODE, GPU_NODE], None),
    (8, {"CPU": 3}, 4, [NODE, NODE, NODE], "ray.num_workers"),  # one 3-CPU bundle a node: 3 workers in all
    (6, {"CPU": 1}, 3, [NODE, {"CPU": 2.0}, NODE], None),  # the small node is left out
    (6, {"CPU": 1}, 3, [NODE, {"CPU": 2.0}, {"CPU": 2.0}], "ray.workers_per_node"),  # room for 8, a group of 3 on one
]


@pytest.mark.parametrize(("workers", "bundle", "strategy", "nodes", "fits"), PLACEMENT)
def test_placement_feasibility(workers, bundle, strategy, nodes, fits):
    from rayft.placement import Request

    assert Request(workers, bundle, strategy).fits(nodes) is fits


@pytest.mark.parametrize(("workers", "bundle", "per_node", "nodes", "refused_by"), PER_NODE)
def test_placement_feasibility_with_several_workers_per_node(workers, bundle, per_node, nodes, refused_by):
    from rayft.placement import Request

    request = Request(workers, bundle, "PACK", per_node)
    assert request.fits(nodes) is (refused_by is None)
    if refused_by:
        assert request.refusal(nodes, "the cluster").startswith(refused_by)


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("H100", "h100"),
        ("H200", "h200"),
        ("GH200", "gh200"),
        ("A100-80G", "a100"),
        ("B200", "b200"),
        ("L40S", "l40s"),
        ("H20", None),
        ("GB200", None),
        ("T4", None),
    ],
)
def test_rays_accelerator_types_name_the_planners_gpus(kind, name):
    """Ray's `accelerator_type:` resource names what the job's GPU is (`rayft.placement.cluster_gpu`): a kind the
    planner knows by its own name or a variant of it (A100-80G), never a different GPU that contains its letters."""
    from rayft.gpus import gpu_named

    assert gpu_named(kind) == name


def test_the_clusters_gpu_is_its_one_known_accelerator_type():
    """What `rayft.placement.cluster_gpu` reads from `ray.cluster_resources()` to plan `auto` recompute for: one kind
    of GPU node, named as the planner names it; mixed kinds or an unknown one leave nothing to plan for."""
    from rayft.placement import gpu_of

    h200_nodes = {"CPU": 64.0, "GPU": 16.0, "accelerator_type:H200": 2.0, "node:10.0.0.1": 1.0}
    assert gpu_of(h200_nodes) == "h200"
    assert gpu_of({"CPU": 8.0}) is None
    assert gpu_of({**h200_nodes, "accelerator_type:H100": 1.0}) is None
    assert gpu_of({"GPU": 8.0, "accelerator_type:H20": 1.0}) is None

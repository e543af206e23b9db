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


@pytest.mark.parametrize(("workers", "bundle", "strategy", "nodes", "fits"), PLACEMENT)
def test_placement_feasibility(workers, bundle, strategy, nodes, fits):
    from rayft.placement import Request

    assert Request(workers, bundle, strategy).fits(nodes) is fits

"""Process groups cut from where Ray placed the ranks (rayft.parallel.topology): the expected groups worked out by
hand for a placement that does not number a node's ranks consecutively."""

from __future__ import annotations

import pytest

from rayft.config import ConfigError
from rayft.parallel.topology import Topology

INTERLEAVED = Topology(("a", "b", "a", "b", "a", "b"))  # ranks 0, 2, 4 on node a; 1, 3, 5 on node b


def test_groups_follow_the_nodes_not_the_rank_numbers():
    assert INTERLEAVED.nodes == ((0, 2, 4), (1, 3, 5))
    assert INTERLEAVED.groups(3).tolist() == [[0, 2, 4], [1, 3, 5]]  # one node each
    assert INTERLEAVED.groups(6).tolist() == [[0, 1, 2, 3, 4, 5]]  # ascending: group rank = place in the row
    assert [INTERLEAVED.nodes_spanned(row) for row in INTERLEAVED.groups(3).tolist()] == [1, 1]
    assert INTERLEAVED.nodes_spanned([0, 1]) == 2


def test_a_placement_other_than_the_asked_workers_per_node_is_refused():
    INTERLEAVED.check_workers_per_node(3)
    with pytest.raises(ConfigError, match=r"ray.workers_per_node 2: Ray placed \[3, 1\] workers"):
        Topology(("a", "b", "a", "a")).check_workers_per_node(2)


def test_the_layout_cuts_each_mesh_and_group_once(process_group):
    """Asked again, the layout hands back what it made: cutting a mesh or group anew would make new process groups
    (a collective on every rank) that no collective runs on."""
    from rayft.parallel.layout import ParallelDims

    layout = ParallelDims(Topology(("local",)), shard=1, experts=1, device_type="cpu")
    assert layout.expert_mesh() is layout.expert_mesh()
    assert layout.own_expert_group() is layout.own_expert_group()
    (group, index), (again, index_again) = layout.own_context_group(), layout.own_context_group()
    assert group is again and index == index_again == 0

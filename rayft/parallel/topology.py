"""Which node each rank runs on, as Ray placed it: every rank's node id gathered once over the process group.

The meshes that keep collectives inside a node (node-local expert-parallel groups, HSDP sharded within a node) are
built from this, never from arithmetic on the rank: Ray Train happens to number a node's workers consecutively, but
nothing promises that a node holds `ray.workers_per_node` of them (PACK places greedily on a cluster other jobs
share), so the placement is read back and checked rather than assumed. Outside Ray (ranks spawned by hand) a rank's
node is its host.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from rayft.config import ConfigError

log = logging.getLogger("rayft")


@dataclass(frozen=True)
class Topology:
    """The node id of every rank (index = rank)."""

    node_ids: tuple[str, ...]

    @cached_property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each node, nodes in the order of their lowest rank."""
        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(self.node_ids):
            by_node.setdefault(node, []).append(rank)
        return tuple(tuple(ranks) for ranks in by_node.values())

    def node_ordered(self) -> torch.Tensor:
        """Every rank, a node's ranks together: consecutive groups of this cut along node boundaries."""
        return torch.tensor([rank for ranks in self.nodes for rank in ranks], dtype=torch.int)

    def groups(self, size: int) -> torch.Tensor:
        """[W / size, size]: consecutive groups of `size` node-ordered ranks, one per row, ascending (a process
        group numbers its ranks in that order, a mesh by their place in the row: the two agree). Each row lies
        within one node when `size` divides every node's worker count, and spans whole nodes when those counts
        divide it."""
        return self.node_ordered().view(-1, size).sort(dim=1).values

    def nodes_spanned(self, ranks: list[int]) -> int:
        return len({self.node_ids[r] for r in ranks})

    def check_workers_per_node(self, expected: int) -> None:
        """ConfigError unless every node holds exactly `expected` workers."""
        counts = sorted({len(ranks) for ranks in self.nodes})
        if counts != [expected]:
            raise ConfigError(
                f"ray.workers_per_node {expected}: Ray placed {[len(r) for r in self.nodes]} workers on the "
                f"{len(self.nodes)} nodes it used; give each worker a node's share of its resources "
                "(ray.resources_per_worker, e.g. GPU: 1 on nodes of that many GPUs) so a node holds exactly "
                f"{expected}, or set ray.workers_per_node to what the nodes hold"
            )


def this_node() -> str:
    """Ray's id of the node this process runs on; the host name outside Ray."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else socket.gethostname()


def gather(world: int) -> Topology:
    """The topology of the default process group of `world` ranks: every rank's node, gathered (a collective)."""
    ids: list[str | None] = [None] * world
    dist.all_gather_object(ids, this_node())
    return Topology(tuple(str(i) for i in ids))


def establish(workers_per_node: int, world: int) -> Topology:
    """At a training worker's set-up: the topology of its `world` ranks, checked against `ray.workers_per_node` when
    several are asked for (one a node is the default, which other strategies than STRICT_SPREAD may pack together)."""
    topology = gather(world)
    if workers_per_node > 1:
        topology.check_workers_per_node(workers_per_node)
    if dist.get_rank() == 0:
        log.info(
            "topology: %d node(s), ranks %s; node of each rank: %s",
            len(topology.nodes),
            [list(r) for r in topology.nodes],
            list(topology.node_ids),
        )
    return topology

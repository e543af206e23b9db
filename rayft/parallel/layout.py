"""One run's parallel layout on its workers, built once at a worker's set-up and handed to what cuts process groups
from it (torchtitan's `ParallelDims` plays this part there).

It holds where Ray placed each rank (`rayft.parallel.topology`) and the two degrees the config fixes: the ranks an
FSDP shard group spans and the workers that share each MoE layer's experts. The meshes are cut from the topology's
node-ordered ranks, so a group of a node's size lies within one node, and each group's span is handed to the
collective tally as it is made (which ranks, on how many nodes), so the tally holds facts of groups, not the
topology.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rayft.config import Config
from rayft.parallel import topology
from rayft.parallel.tally import TALLY
from rayft.parallel.topology import Topology

log = logging.getLogger("rayft")


@dataclass
class ParallelDims:
    """World, nodes and the groups of one run. `shard`: ranks an FSDP shard group spans (the world: FSDP over every
    rank, no mesh); `experts`: k, the workers that share each MoE layer's experts (1: none); `context`: N, the
    workers each sequence is split over (1: none)."""

    topology: Topology
    shard: int
    experts: int
    device_type: str
    context: int = 1

    @property
    def world(self) -> int:
        return len(self.topology.node_ids)

    @property
    def nodes(self) -> int:
        return len(self.topology.nodes)

    def fsdp_mesh(self) -> DeviceMesh | None:
        """None (fully_shard's default: shard over every rank), or a (replicate, shard) mesh whose shard groups are
        `shard` consecutive node-ordered ranks: with a node's workers in each, every node holds one copy between
        them (gathers on the node's links) and the copies on different nodes are the replicas."""
        if self.shard == self.world:
            return None
        return self._mesh(self.shard, ("replicate", "shard"))

    def expert_mesh(self) -> DeviceMesh:
        """The (dp, ep) mesh: each row an ep-group, k consecutive node-ordered ranks (within one node whenever k
        divides its workers); the rows along `dp` hold the same experts."""
        return self._mesh(self.experts, ("dp", "ep"))

    def own_expert_group(self) -> dist.ProcessGroup:
        """This worker's ep-group as a process group of its own (every worker creates all of them, in order), so the
        all-to-all never queues behind FSDP's collectives on the mesh's groups."""
        mine = None
        for ranks in self.topology.groups(self.experts).tolist():
            group = dist.new_group(ranks)
            TALLY.learn(group, ranks, self.topology)
            if dist.get_rank() in ranks:
                mine = group
        return cast(dist.ProcessGroup, mine)  # every rank is in one of the groups

    def own_context_group(self) -> tuple[dist.ProcessGroup, int]:
        """This worker's context-parallel group (N consecutive node-ordered ranks: within a node whenever N divides
        its workers, so the per-layer all-to-alls stay on its links) and the group's index, its data-parallel rank:
        the ranks of a group read the same rows. Every worker creates all of them, in order."""
        mine: tuple[dist.ProcessGroup, int] | None = None
        for index, ranks in enumerate(self.topology.groups(self.context).tolist()):
            group = dist.new_group(ranks)
            TALLY.learn(group, ranks, self.topology)
            if dist.get_rank() in ranks:
                mine = (group, index)
        return cast("tuple[dist.ProcessGroup, int]", mine)  # every rank is in one of the groups

    def _mesh(self, size: int, names: tuple[str, str]) -> DeviceMesh:
        """Rows of `size` consecutive node-ordered ranks; each dimension's group told to the tally."""
        mesh = DeviceMesh(self.device_type, self.topology.groups(size), mesh_dim_names=names)
        for name in names:
            group = mesh.get_group(name)
            TALLY.learn(group, dist.get_process_group_ranks(group), self.topology)
        return mesh


def parallel_dims(cfg: Config, device_type: str, placed: Topology | None = None) -> ParallelDims:
    """The layout `cfg` asks for on the ranks as placed (`placed`, else gathered now: a collective). Under expert
    parallelism the rest is sharded over each node's workers (`rayft.parallel.expert` says why)."""
    placed = placed or topology.gather()
    world = len(placed.node_ids)
    TALLY.learn(cast(dist.ProcessGroup, dist.group.WORLD), list(range(world)), placed)  # set: `gather` ran on it
    k = cfg.parallel.expert_groups()
    shard = cfg.ray.workers_per_node if k > 1 else cfg.fsdp.shard_group(world)
    return ParallelDims(placed, shard, k, device_type, cfg.parallel.context_parallel)

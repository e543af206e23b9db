"""One run's parallel layout on its workers, built once at a worker's set-up and handed to what cuts process groups
from it (torchtitan's `ParallelDims` plays this part there).

It holds where Ray placed each rank (`rayft.parallel.topology`) and the degrees the config and the driver's
decisions fix: the ranks an FSDP shard group spans (the rest replicate it), the workers that share each MoE layer's
experts and those each sequence is split over. The meshes are cut from the topology's node-ordered ranks, so a group
of a node's size lies within one node, and each group's span is handed to the collective tally as it is made (which
ranks, on how many nodes), so the tally holds facts of groups, not the topology.

Each mesh and group is made once, when first asked for, and kept: cutting one again would make new process groups
(a collective) and tell the tally of groups no collective runs on. The expert and context parallelism the model is
built with (`rayft.parallel.parallelize`) are kept here too, so the step, the checkpoints and the loop read them
from the layout the Trainer holds rather than finding them in the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rayft.config import Config
from rayft.decisions import Decisions
from rayft.parallel import topology
from rayft.parallel.context import ContextParallel, enable_context_parallel
from rayft.parallel.expert import ExpertParallel, routed_experts
from rayft.parallel.tally import TALLY
from rayft.parallel.topology import Topology

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T = TypeVar("T")

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
    _made: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def world(self) -> int:
        return len(self.topology.node_ids)

    @property
    def nodes(self) -> int:
        return len(self.topology.nodes)

    @property
    def replicate(self) -> int:
        """The copies of FSDP's shards: one per shard group."""
        return self.world // self.shard

    @property
    def data_ranks(self) -> int:
        """The data-parallel ranks: each context-parallel group reads the same rows (every rank without)."""
        return self.world // self.context

    def _once(self, name: str, make: Callable[[], T]) -> T:
        """What `make` returns, made on the first call only."""
        if name not in self._made:
            self._made[name] = make()
        return cast(T, self._made[name])

    def fsdp_mesh(self) -> DeviceMesh | None:
        """None (fully_shard's default: shard over every rank), or a (replicate, shard) mesh whose shard groups are
        `shard` consecutive node-ordered ranks: with a node's workers in each, every node holds one copy between
        them (gathers on the node's links) and the copies on different nodes are the replicas."""
        if self.shard == self.world:
            return None
        return self._once("fsdp_mesh", lambda: self._mesh(self.shard, ("replicate", "shard")))

    def replica_group(self) -> dist.ProcessGroup | None:
        """This rank's group of replicas of its FSDP shard (the mesh's first dimension); None without replicas."""
        mesh = self.fsdp_mesh()
        return mesh.get_group("replicate") if mesh is not None and self.replicate > 1 else None

    def expert_mesh(self) -> DeviceMesh:
        """The (dp, ep) mesh: each row an ep-group, k consecutive node-ordered ranks (within one node whenever k
        divides its workers); the rows along `dp` hold the same experts."""
        return self._once("expert_mesh", lambda: self._mesh(self.experts, ("dp", "ep")))

    def own_expert_group(self) -> dist.ProcessGroup:
        """This worker's ep-group as a process group of its own (every worker creates all of them, in order), so the
        all-to-all never queues behind FSDP's collectives on the mesh's groups."""
        return self._once("expert_group", lambda: self._own_group(self.experts)[0])

    def own_context_group(self) -> tuple[dist.ProcessGroup, int]:
        """This worker's context-parallel group (N consecutive node-ordered ranks: within a node whenever N divides
        its workers, so the per-layer all-to-alls stay on its links) and the group's index, its data-parallel rank:
        the ranks of a group read the same rows. Every worker creates all of them, in order."""
        return self._once("context_group", lambda: self._own_group(self.context))

    def split_experts(self, model_config: Any) -> ExpertParallel:
        """This worker's expert parallelism for the model being built, of `model_config` (k > 1): the (dp, ep) mesh
        and its groups; ConfigError when k does not fit the model. Kept for `expert_parallel` (a layout serves the
        one model built on it)."""
        experts = routed_experts(self.experts, self.world, model_config)
        mesh = self.expert_mesh()
        dp_group = mesh.get_group("dp") if self.world > self.experts else None
        made = ExpertParallel(self.experts, experts, mesh, self.own_expert_group(), dp_group, self.world)
        self._made["expert_parallel"] = made
        return made

    def split_sequences(self, model: PreTrainedModel) -> ContextParallel:
        """The attention of `model`, being built, split over this worker's context-parallel group (N > 1). Kept for
        `context_parallel` (a layout serves the one model built on it)."""
        group, index = self.own_context_group()
        made = enable_context_parallel(model, self.context, group, (index, self.data_ranks))
        self._made["context_parallel"] = made
        return made

    @property
    def expert_parallel(self) -> ExpertParallel | None:
        """The expert parallelism the model was built with (`split_experts`); None for k = 1."""
        return self._built("expert_parallel") if self.experts > 1 else None

    @property
    def context_parallel(self) -> ContextParallel | None:
        """The context parallelism the model was built with (`split_sequences`); None for N = 1."""
        return self._built("context_parallel") if self.context > 1 else None

    def _built(self, name: str) -> Any:
        if name not in self._made:
            raise RuntimeError(f"the layout's {name} is made as the model is built (build_model with this layout)")
        return self._made[name]

    def _own_group(self, size: int) -> tuple[dist.ProcessGroup, int]:
        """This worker's group among the groups of `size` consecutive node-ordered ranks, and its index; every
        worker creates all of them, in order."""
        mine: tuple[dist.ProcessGroup, int] | None = None
        for index, ranks in enumerate(self.topology.groups(size).tolist()):
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


def parallel_dims(
    cfg: Config, device_type: str, placed: Topology | None = None, decisions: Decisions | None = None
) -> ParallelDims:
    """The layout `cfg` asks for, with the degrees the driver `decisions` fixed (else the config's own), on the
    ranks as placed (`placed`, else gathered now: a collective). Under expert parallelism the rest is sharded over
    each node's workers (`rayft.parallel.expert` says why)."""
    placed = placed or topology.gather(dist.get_world_size())
    world = len(placed.node_ids)
    TALLY.learn(cast(dist.ProcessGroup, dist.group.WORLD), list(range(world)), placed)  # set: `gather` ran on it
    k = (decisions or Decisions.of(cfg)).expert_parallel
    shard = cfg.ray.workers_per_node if k > 1 else cfg.fsdp.shard_group(world)
    return ParallelDims(placed, shard, k, device_type, cfg.parallel.context_parallel)


def established(cfg: Config, device_type: str, decisions: Decisions) -> ParallelDims:
    """At a worker's set-up: the run's layout on where Ray placed each rank (checked against
    `ray.workers_per_node`, in the job log), with the groups the config and `decisions` cut from it."""
    placed = topology.establish(cfg.ray.workers_per_node, dist.get_world_size())
    return parallel_dims(cfg, device_type, placed, decisions)

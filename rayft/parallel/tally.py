"""A per-step tally of the bytes collectives moved into this rank, so the planner's predictions can be checked.

Convention (one for every kind, so the numbers add up): bytes this rank *received from other ranks* in the step,
as a ring or pairwise algorithm moves them:
  all_gather      output bytes · (W−1)/W
  reduce_scatter  input bytes · (W−1)/W
  all_reduce      bytes · 2(W−1)/W
  all_to_all      output bytes less the part this rank sent itself

Of those, `inter_node` is what crosses the network between nodes, by the planner's model (`rayft.plan.comm`): a
group of g ranks on n nodes, each rank with its own NIC, moves (n−1)/(g−1) of a ring collective's bytes over the
network (T·(n−1)/g of a T-byte all-gather: what the other nodes hold, shared by the node's NICs); an all-to-all,
the rows that came from ranks on other nodes (counted, not modelled). Nodes are where Ray placed the ranks
(`rayft.parallel.topology`), each group's span learnt as the layout makes it (`rayft.parallel.layout`); a group
within one node moves nothing over the network.
"""

from __future__ import annotations

from collections import Counter
from typing import cast

import torch.distributed as dist

from rayft.parallel.topology import Topology

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
INTER_NODE = "inter_node"
TALLIED = (*KINDS, INTER_NODE)  # what `take()` returns: bytes by kind, then their inter-node part


class CollectiveTally:
    """Bytes per collective kind since the last `take()`; one per process (collectives run on one thread each)."""

    def __init__(self) -> None:
        self._bytes: Counter[str] = Counter()
        self._spans: dict[dist.ProcessGroup, tuple[int, int]] = {}  # → (ranks, nodes)
        self._remote: dict[dist.ProcessGroup, tuple[bool, ...]] = {}  # → per group rank: on another node

    def learn(self, group: dist.ProcessGroup, ranks: list[int], topology: Topology) -> None:
        """Where a process group's ranks run, as it is made (`rayft.parallel.layout`): its span in ranks and nodes,
        and for each of its ranks, in its order, whether it runs on another node than this rank."""
        here = topology.node_ids[dist.get_rank()]
        self._spans[group] = (len(ranks), topology.nodes_spanned(ranks))
        self._remote[group] = tuple(topology.node_ids[r] != here for r in ranks)

    def add(
        self, kind: str, nbytes: int, group: dist.ProcessGroup | None = None, inter_node: int | None = None
    ) -> None:
        """`nbytes` received by a collective of `kind` on `group` (None: every rank); `inter_node`: how many of
        them came over the network, when counted rather than modelled (the all-to-all's rows)."""
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(KINDS)}")
        self._bytes[kind] += int(nbytes)
        if inter_node is None:
            ranks, nodes = self.spans(group)
            inter_node = int(nbytes) * (nodes - 1) // (ranks - 1) if ranks > 1 else 0
        self._bytes[INTER_NODE] += int(inter_node)

    def spans(self, group: dist.ProcessGroup | None) -> tuple[int, int]:
        """(ranks, nodes) of a process group (None: every rank)."""
        group = group or cast(dist.ProcessGroup, dist.group.WORLD)  # set: a collective ran on it
        if group not in self._spans:
            self._learn_unplaced(group)
        return self._spans[group]

    def remote(self, group: dist.ProcessGroup) -> tuple[bool, ...]:
        """For each rank of `group`, in the group's order, whether it runs on another node than this rank."""
        if group not in self._remote:
            self._learn_unplaced(group)
        return self._remote[group]

    def _learn_unplaced(self, group: dist.ProcessGroup) -> None:
        """A group no layout made (a model sharded by hand, without rayft's set-up): nothing says where its ranks
        run, so none of its bytes are counted as crossing nodes."""
        ranks = dist.get_process_group_ranks(group)
        self._spans[group] = (len(ranks), 1)
        self._remote[group] = (False,) * len(ranks)

    def take(self) -> dict[str, int]:
        """The tally since the last call, every kind present (0 where none moved), then start afresh."""
        taken = {kind: self._bytes.get(kind, 0) for kind in TALLIED}
        self._bytes.clear()
        return taken


TALLY = CollectiveTally()

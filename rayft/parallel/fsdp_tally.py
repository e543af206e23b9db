"""FSDP2's collectives counted into `TALLY`, from the tensors FSDP2 hands to them.

Why FSDP2's hooks rather than a TorchDispatchMode on the c10d ops: a dispatch mode runs Python for every aten op
of the step (thousands per micro-batch), while FSDP2 calls its all-gather, reduce-scatter and HSDP all-reduce hook
once per FSDP unit and step phase, so counting there costs one Python call per collective, next to a collective
that moves kilobytes to gigabytes. The wrappers keep FSDP2's own communication (`DefaultAllGather`,
`DefaultReduceScatter`) and only add the bytes:
  all-gather      output bytes · (g−1)/g          g = ranks of the shard group
  reduce-scatter  input bytes · (g−1)/g
  HSDP all-reduce 2 · bytes · (R−1)/R            R = replicas (the mesh's first dimension), after the reduce-scatter
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from rayft.parallel.layout import ParallelDims
from rayft.parallel.tally import TALLY


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CountedAllGather(AllGather):
    def __init__(self, inner: AllGather | None = None) -> None:
        self.inner = inner or DefaultAllGather()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        ranks = group.size()
        TALLY.add("all_gather", _nbytes(output_tensor) * (ranks - 1) // ranks, group)
        return self.inner(output_tensor, input_tensor, group, async_op)


class CountedReduceScatter(ReduceScatter):
    def __init__(self, inner: ReduceScatter | None = None) -> None:
        self.inner = inner or DefaultReduceScatter()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        ranks = group.size()
        TALLY.add("reduce_scatter", _nbytes(input_tensor) * (ranks - 1) // ranks, group)
        return self.inner(output_tensor, input_tensor, group, op, async_op)


def count_fsdp_collectives(model: nn.Module, layout: ParallelDims) -> int:
    """Count every FSDP unit's all-gathers and reduce-scatters (and HSDP all-reduces, over the replicas of
    `layout`, the layout `model` was sharded on) into `TALLY`; returns the number of units counted."""
    replicas = layout.replica_group()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_custom_all_gather(CountedAllGather())
        unit.set_custom_reduce_scatter(CountedReduceScatter())
        if replicas is not None:
            unit.set_all_reduce_hook(_all_reduce_counter(replicas))
    return len(units)


def _all_reduce_counter(group: dist.ProcessGroup) -> Callable[[torch.Tensor], None]:
    replicas = group.size()

    def counted(reduce_output: torch.Tensor) -> None:
        """Runs after FSDP2's HSDP all-reduce of the reduce-scattered gradients (it issues that one itself)."""
        TALLY.add("all_reduce", 2 * _nbytes(reduce_output) * (replicas - 1) // replicas, group)

    return counted

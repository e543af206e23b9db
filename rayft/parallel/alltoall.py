"""All-to-all with autograd and uneven splits, counted in the collective tally.

gloo implements `all_to_all_single` with uneven split sizes on CPU (checked with torch 2.13), so the same code runs
on gloo and NCCL. The backward of an all-to-all is the all-to-all with the splits swapped: the gradient of each
row goes back to the rank the row came from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rayft.parallel.tally import TALLY


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows `x` (`in_splits[r]` of them for rank r, in rank order) sent out; the rows received, `out_splits[r]`
    from rank r, in rank order. Differentiable in `x`."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal chunks of an integer vector to every rank of `group` (chunk r to rank r), no autograd: the split sizes
    every rank needs before the rows can move."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    _tally(received, [received.numel() // dist.get_world_size(group)] * dist.get_world_size(group), group)
    return received


def _tally(received: torch.Tensor, out_splits: list[int], group: dist.ProcessGroup) -> None:
    """Bytes from other ranks: what arrived less the part this rank sent itself."""
    row_bytes = received[0].numel() * received.element_size() if received.shape[0] else 0
    own = out_splits[dist.get_rank(group)]
    TALLY.add("all_to_all", (sum(out_splits) - own) * row_bytes)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    _tally(out, out_splits, group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None

"""All-to-all with autograd and uneven splits, counted in the collective tally, and saved by activation
checkpointing rather than run again.

gloo implements `all_to_all_single` with uneven split sizes on CPU (checked with torch 2.13), so the same code runs
on gloo and NCCL. The backward of an all-to-all is the all-to-all with the splits swapped: the gradient of each
row goes back to the rank the row came from.

Both exchanges are custom ops (`rayft::all_to_all`, `rayft::all_to_all_counts`) rather than Python around
`dist.all_to_all_single`, so a selective checkpoint policy can name them: `checkpoint_context` makes the recompute
of a checkpointed layer reuse their saved outputs (as torchtitan does for its expert-parallel all-to-alls): no
exchange, and no tally, is repeated in backward. The op's implementation is the only place that moves and counts.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

# torch imports it from torch._C._distributed_c10d without listing it among its exports
from torch.distributed.distributed_c10d import _resolve_process_group  # type: ignore[attr-defined]
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from rayft.parallel.tally import TALLY

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.distributed.distributed_c10d import GroupName
    from torch.utils.checkpoint import SelectiveCheckpointContext


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows `x` (`in_splits[r]` of them for rank r, in rank order) sent out; the rows received, `out_splits[r]`
    from rank r, in rank order. Differentiable in `x`."""
    return cast(torch.Tensor, torch.ops.rayft.all_to_all(x, out_splits, in_splits, group.group_name))


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal chunks of an integer vector to every rank of `group` (chunk r to rank r), no autograd: the split sizes
    every rank needs before the rows can move."""
    return cast(torch.Tensor, torch.ops.rayft.all_to_all_counts(counts, group.group_name))


def _tally(received: torch.Tensor, out_splits: list[int], group: dist.ProcessGroup) -> None:
    """Bytes from other ranks: what arrived less the part this rank sent itself; those from ranks on other nodes
    crossed the network."""
    row_bytes = received[0].numel() * received.element_size() if received.shape[0] else 0
    own = out_splits[dist.get_rank(group)]
    remote = sum(rows for rows, far in zip(out_splits, TALLY.remote(group), strict=True) if far)
    TALLY.add("all_to_all", (sum(out_splits) - own) * row_bytes, group, inter_node=remote * row_bytes)


@torch.library.custom_op("rayft::all_to_all", mutates_args=())
def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str) -> torch.Tensor:
    group = _resolve_process_group(cast("GroupName", group_name))
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    _tally(out, out_splits, group)
    return out


@_all_to_all.register_fake
def _(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str) -> torch.Tensor:
    return x.new_empty((sum(out_splits), *x.shape[1:]))


def _setup(ctx: Any, inputs: tuple[torch.Tensor, list[int], list[int], str], output: torch.Tensor) -> None:
    _, ctx.out_splits, ctx.in_splits, ctx.group_name = inputs


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
    return torch.ops.rayft.all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group_name), None, None, None


_all_to_all.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("rayft::all_to_all_counts", mutates_args=())
def _all_to_all_counts(counts: torch.Tensor, group_name: str) -> torch.Tensor:
    group = _resolve_process_group(cast("GroupName", group_name))
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    ranks = dist.get_world_size(group)
    _tally(received, [received.numel() // ranks] * ranks, group)
    return received


@_all_to_all_counts.register_fake
def _(counts: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(counts)


SAVED = (torch.ops.rayft.all_to_all.default, torch.ops.rayft.all_to_all_counts.default)


def _save_exchanges(ctx: SelectiveCheckpointContext, op: OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_context() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """`context_fn` for `torch.utils.checkpoint.checkpoint`: keep the exchanges' outputs, recompute the rest."""
    # torch leaves create_selective_checkpoint_contexts unannotated; it returns two TorchDispatchModes.
    contexts: tuple[AbstractContextManager[Any], AbstractContextManager[Any]]
    contexts = create_selective_checkpoint_contexts(_save_exchanges)  # type: ignore[no-untyped-call]
    return contexts

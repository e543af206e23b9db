"""A run whose loss, gradients or weights stop being finite numbers stops at once, naming the step, rather than
training on and writing NaN weights as its checkpoints and final adapter.

Each step's check stays on the device (a few element-wise kernels, no host sync); the host reads it with reductions
it waits for anyway: the logging window's (`rayft.train.metrics.LossWindow.take`) and the one before every
checkpoint and the final adapter, which also checks the weights themselves.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

# What each entry of `FiniteWatch.first` watches.
WATCHED = ("the loss", "the gradient norm", "the adapter's weights")


class NonFinite(RuntimeError):
    """The run stopped at a step whose loss, gradient norm or weights are not finite; the message is one line."""


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2's sharded parameters, a clipped norm), the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class FiniteWatch:
    """The first step at which each of `WATCHED` was not finite (inf while it has been), kept on the device."""

    def __init__(self, device: torch.device):
        self.first = torch.full((len(WATCHED),), math.inf, dtype=torch.float64, device=device)

    def note(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """After optimizer step `step`: `loss`, a sum its losses went into (a non-finite term leaves it non-finite),
        and the gradient norm. No host sync."""
        finite = torch.stack([loss.isfinite(), local(grad_norm).isfinite()])
        self._mark(slice(0, 2), finite, step)

    def note_weights(self, step: int, params: Iterable[torch.Tensor]) -> None:
        """Whether this rank's part of the trainable weights is finite after step `step`."""
        parts = [local(p.detach()).isfinite().all() for p in params]
        finite = torch.stack(parts).all() if parts else torch.ones((), dtype=torch.bool, device=self.first.device)
        self._mark(slice(2, 3), finite.reshape(1), step)

    def _mark(self, entries: slice, finite: torch.Tensor, step: int) -> None:
        kept = self.first[entries]
        self.first[entries] = torch.where(finite, kept, kept.clamp(max=step))

    def for_max(self) -> torch.Tensor:
        """The entries negated, to ride in a MAX all-reduce (the max of the negated is the earliest step)."""
        return -self.first

    def checked(self) -> tuple[int, str] | None:
        """The earliest step over all ranks and what was not finite at it; one all-reduce, waited for."""
        first = self.first.clone()
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        return found(first.tolist())


def found(first: list[float]) -> tuple[int, str] | None:
    """(step, "the loss and the gradient norm") of the earliest non-finite entry, None where all are finite."""
    step = min(first)
    if math.isinf(step):
        return None
    what = [name for name, at in zip(WATCHED, first, strict=True) if at == step]
    return int(step), " and ".join(what)

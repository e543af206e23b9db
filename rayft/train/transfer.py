"""Host batches onto the training device.

`non_blocking=True` from pageable host memory is a synchronous copy on CUDA (the driver stages it through a pinned
buffer itself), so a batch bound for a GPU is pinned first: the copy then overlaps the step's kernels. On CPU the
batch is already where it trains, and pinning would need an accelerator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rayft.model.loss import Batch


def pins(device: torch.device, tensor: torch.Tensor) -> bool:
    """Whether `tensor` is pinned before its copy to `device`: a host tensor bound for a CUDA device."""
    return device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned()


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Every tensor of `batch` on `device`, copied from pinned memory when that lets the copy run asynchronously;
    what is no tensor (a context-parallel shard's `SequenceShard`) as it is."""
    return {
        k: (v.pin_memory() if pins(device, v) else v).to(device, non_blocking=True) if torch.is_tensor(v) else v
        for k, v in batch.items()
    }

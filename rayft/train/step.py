"""One optimizer step and one evaluation pass, and the stream of micro-batches that feeds the steps."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist

from rayft.config import Config
from rayft.model.build import reshard_all, set_gradient_sync
from rayft.parallel.tally import TALLY
from rayft.train.checkpoint import Progress
from rayft.train.metrics import LossWindow, attended_keys
from rayft.train.schedule import Plan
from rayft.train.transfer import to_device

log = logging.getLogger("rayft")

Batch = dict[str, torch.Tensor]


def train_step(
    model,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    group: list[Batch],
    window: LossWindow,
    *,
    world_size: int,
    kept_layers: list,
    autocast: Callable[[], Any],
    max_grad_norm: float,
) -> torch.Tensor:
    """Forward and backward over the step's micro-batches, then clip, step and advance the schedule; returns the
    gradient norm before clipping. Gradients are synchronised on the last micro-batch only.

    Every target token of the step weighs the same, on every rank and in every micro-batch (as in transformers'
    Trainer): each loss is a sum over its tokens divided by the step's count per rank.
    """
    window.run()  # the window's clock counts from the first step on
    per_rank = step_targets(group, world_size)
    for i, batch in enumerate(group):
        last = i == len(group) - 1
        set_gradient_sync(model, last, kept_layers)
        with autocast():
            loss = model(**batch, num_items_in_batch=per_rank).loss
        loss.backward()
        mask = batch.get("attention_mask")  # none in padding-free batches: every token counts
        tokens = mask.sum() if mask is not None else torch.full((), batch["input_ids"].numel(), device=loss.device)
        window.add(loss.detach(), last, tokens, attended_keys(batch))
    grad_norm = clip_gradients_(model, max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    window.add_moved(TALLY.take())
    return grad_norm


def clip_gradients_(model, max_grad_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm and return it; with expert parallelism the expert LoRA's gradients are
    averaged first and its norm summed over the workers holding different experts (`rayft.parallel.expert`)."""
    ep = getattr(model, "expert_parallel", None)
    if ep is not None:
        return ep.clip_gradients_(model, max_grad_norm)
    return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)


@torch.no_grad()
def evaluate(
    model, shard, batch_size: int, collate, device: torch.device, autocast: Callable[[], Any] = nullcontext
) -> float:
    """Token-weighted mean loss over every rank's validation shard."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in shard.iter_torch_batches(batch_size=batch_size, collate_fn=collate):
        batch = to_device(batch, device)
        predicted = targets(batch)
        with autocast():
            loss = model(**batch).loss
        totals += torch.stack([loss.double() * predicted, predicted.double()])
    reshard_all(model)  # no backward follows: free what forward kept gathered for it
    model.train()
    TALLY.take()  # evaluation's gathers are not a training step's
    dist.all_reduce(totals)
    return totals[0].item() / totals[1].item() if totals[1] > 0 else math.nan


def targets(batch: Batch) -> torch.Tensor:
    """Tokens a batch is scored on: labels other than -100 after the one-position shift."""
    return (batch["labels"][..., 1:] != -100).sum()


def step_targets(group: list[Batch], world_size: int) -> torch.Tensor:
    """Next-token targets in this step's micro-batches over all ranks, divided by the ranks (FSDP averages the
    gradients over them); one small all-reduce per step, no host sync."""
    count = sum(targets(batch) for batch in group).double()
    dist.all_reduce(count)
    TALLY.add("all_reduce", 2 * count.element_size() * (world_size - 1) // world_size)
    return (count / world_size).clamp_min(1.0)


def step_groups(
    shard, cfg: Config, plan: Plan, progress: Progress, collate, waited: DataWait, device: torch.device
) -> Iterator[tuple[list[Batch], int]]:
    """The micro-batches of each optimizer step (on the device) with the index in the epoch of its last one,
    from the progress's data position on, epoch after epoch until the plan's steps are done. The caller moves
    `progress.step` and `batches_in_epoch`; the epoch rolls over here. The last group of an epoch may be short."""
    accum = cfg.train.gradient_accumulation_steps
    while progress.step < plan.total_steps:
        skip = progress.batches_in_epoch
        group: list[Batch] = []
        for micro, batch in enumerate(waited(epoch_batches(shard, cfg, plan, progress.epoch, skip, collate)), skip):
            group.append(to_device(batch, device))
            if len(group) == min(accum, plan.micro_batches_per_epoch - (micro - micro % accum)):
                yield group, micro
                group = []
        progress.epoch += 1
        progress.batches_in_epoch = 0


def epoch_batches(shard, cfg: Config, plan: Plan, epoch: int, skip: int, collate) -> Iterator[Any]:
    """One epoch of this rank's micro-batches, reshuffled per epoch (seeded, so a rerun sees the same order).

    A resumed epoch replays the same stream and skips what was already trained on. Every rank gets the same
    number of batches (equal split), and never more than the plan counted, so all ranks leave the epoch at the
    same micro-step and no collective waits on a rank that has run out.
    """
    batches = shard.iter_torch_batches(
        batch_size=cfg.train.per_device_train_batch_size,
        collate_fn=collate,
        local_shuffle_buffer_size=cfg.data.shuffle_buffer_size or None,
        local_shuffle_seed=cfg.train.seed + epoch,
    )
    return islice(batches, skip, plan.micro_batches_per_epoch)


class DataWait:
    """Seconds the loop spent waiting for its next batch since the last `take()`. The wait for the very first
    batch is the pipeline's start-up, kept apart until `take_first()`."""

    def __init__(self):
        self.seconds = 0.0
        self.started = False
        self.first: float | None = None

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        while True:
            started = time.perf_counter()
            batch = next(batches, None)
            waited = time.perf_counter() - started
            if batch is None:
                self.seconds += waited
                return
            if self.started:
                self.seconds += waited
            else:
                self.started, self.first = True, waited
                log.info("first batch after %.1f s (data pipeline start-up)", waited)
            yield batch

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def take_first(self) -> float | None:
        first, self.first = self.first, None
        return first

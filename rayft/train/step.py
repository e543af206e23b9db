"""One optimizer step and one evaluation pass, and the stream of micro-batches that feeds the steps."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch
import torch.distributed as dist

from rayft.config import Config
from rayft.model.loss import IGNORE_INDEX, Batch, CausalLMLoss, next_token_targets
from rayft.parallel.layout import ParallelDims
from rayft.parallel.parallelize import reshard_all, set_gradient_sync
from rayft.parallel.tally import TALLY
from rayft.train.checkpoint_dir import Progress
from rayft.train.metrics import LossWindow, attended_keys
from rayft.train.steps import StepPlan
from rayft.train.transfer import to_device

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.optim.lr_scheduler import LRScheduler

    from rayft.train.runtime import Collate, Shard

log = logging.getLogger("rayft")

# (model, micro-batch) → (the micro-batch's loss to backpropagate, its attended tokens)
MicroBatchLoss = Callable[[torch.nn.Module, Batch], tuple[torch.Tensor, torch.Tensor]]
# The context each forward runs in (`rayft.model.build.forward_context`).
Autocast = Callable[[], AbstractContextManager[Any]]


class StepLoss(Protocol):
    """What a step minimises, per micro-batch, given the step's micro-batches: they count what each micro-batch's
    loss is divided by (once per step, over all ranks), so every item of the step weighs the same."""

    def for_step(self, group: list[Batch], world_size: int) -> MicroBatchLoss: ...


class NextTokenLoss:
    """Supervised fine-tuning: every target token of the step weighs the same, on every rank and in every
    micro-batch (as in transformers' Trainer): each loss is a sum over its tokens divided by the step's count per
    rank."""

    def __init__(self, loss: CausalLMLoss) -> None:
        self.loss = loss

    def for_step(self, group: list[Batch], world_size: int) -> MicroBatchLoss:
        per_rank = step_targets(group, world_size)

        def micro_batch_loss(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            loss = self.loss(model, batch, per_rank)
            mask = batch.get("attention_mask")  # none in padding-free batches: every token counts
            tokens = mask.sum() if mask is not None else torch.full((), batch["input_ids"].numel(), device=loss.device)
            return loss, tokens

        return micro_batch_loss


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    group: list[Batch],
    window: LossWindow,
    *,
    loss: StepLoss,
    layout: ParallelDims,
    kept_layers: list[torch.nn.Module],
    autocast: Autocast,
    max_grad_norm: float,
    seeds: list[int] | None = None,
) -> torch.Tensor:
    """Forward and backward over the step's micro-batches with the objective's `loss`, then clip, step and advance
    the schedule; returns the gradient norm before clipping. Gradients are synchronised on the last micro-batch
    only; the collectives of the step go to the window. `layout`: the one the model was built on.
    `seeds`: each micro-batch's random draws (an elastic run)."""
    window.run()  # the window's clock counts from the first step on
    micro_batch_loss = loss.for_step(group, layout.world)
    for i, batch in enumerate(group):
        last = i == len(group) - 1
        if seeds is not None:
            seed_draws(seeds[i], layout)
        set_gradient_sync(cast("FSDPModule", model), last, kept_layers)  # the model is sharded by fully_shard
        with autocast():
            value, tokens = micro_batch_loss(model, batch)
        value.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        window.add(value.detach(), last, tokens, attended_keys(batch))
    grad_norm = clip_gradients_(model, max_grad_norm, layout)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    window.add_moved(TALLY.take())
    return grad_norm


def seed_draws(seed: int, layout: ParallelDims) -> None:
    """Seed this worker's random draws (dropout) for the micro-batch whose seed is `seed`. The N workers of a
    context-parallel group train one micro-batch, each on its own slice of the rows: seeded alike they would drop
    the same positions of every slice, so each mixes in its place in the group."""
    if layout.context > 1:
        group, _ = layout.own_context_group()
        seed = int(np.random.SeedSequence([seed, dist.get_rank(group)]).generate_state(1)[0])
    torch.manual_seed(seed)


def clip_gradients_(model: torch.nn.Module, max_grad_norm: float, layout: ParallelDims) -> torch.Tensor:
    """Clip by the global gradient norm and return it; with expert parallelism (the `layout`'s, which the model was
    built on) the expert LoRA's gradients are averaged first and its norm summed over the workers holding different
    experts (`rayft.parallel.expert`)."""
    ep = layout.expert_parallel
    if ep is not None:
        return ep.clip_gradients_(model, max_grad_norm)
    return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)


@torch.no_grad()
def eval_pass(
    model: torch.nn.Module,
    shard: Shard,
    batch_size: int,
    collate: Collate,
    device: torch.device,
    autocast: Autocast,
    score: Callable[[Batch], None],
) -> None:
    """`score` every batch of this rank's validation shard in eval mode; then the model as training wants it back.
    Evaluation's collectives are not a training step's: they leave the tally."""
    model.eval()
    for batch in shard.iter_torch_batches(batch_size=batch_size, collate_fn=collate):
        batch = to_device(batch, device)
        with autocast():
            score(batch)
    reshard_all(model)  # no backward follows: free what forward kept gathered for it
    model.train()
    TALLY.take()


def mean_eval_loss(
    model: torch.nn.Module,
    loss: CausalLMLoss,
    shard: Shard,
    batch_size: int,
    collate: Collate,
    device: torch.device,
    autocast: Autocast = nullcontext,
) -> float:
    """Token-weighted mean `loss` over every rank's validation shard."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)

    def score(batch: Batch) -> None:
        # the sum over the batch's targets (a divisor of one), as a context-parallel shard may have none
        summed = loss(model, batch, torch.ones((), device=device))
        totals.add_(torch.stack([summed.double(), targets(batch).double()]))

    eval_pass(model, shard, batch_size, collate, device, autocast, score)
    dist.all_reduce(totals)
    return totals[0].item() / totals[1].item() if totals[1] > 0 else math.nan


def targets(batch: Batch) -> torch.Tensor:
    """Tokens a batch is scored on: labels other than -100 after the one-position shift."""
    return (next_token_targets(batch["labels"], batch.get("shift_labels")) != IGNORE_INDEX).sum()


def step_targets(group: list[Batch], world_size: int) -> torch.Tensor:
    """Next-token targets in this step's micro-batches over all ranks, divided by the ranks (FSDP averages the
    gradients over them); one small all-reduce per step, no host sync."""
    count = cast(torch.Tensor, sum(targets(batch) for batch in group)).double()  # a step has micro-batches: not 0
    dist.all_reduce(count)
    TALLY.add("all_reduce", 2 * count.element_size() * (world_size - 1) // world_size, dist.group.WORLD)
    return (count / world_size).clamp_min(1.0)


@dataclass
class StepGroup:
    """One optimizer step's micro-batches of this rank (on the device), the index in the epoch of the step's last
    micro-batch, and, in a run read in global order, the seed of each micro-batch's random draws."""

    batches: list[Batch] = field(default_factory=list)
    last: int = -1
    seeds: list[int] | None = None


def step_groups(
    shard: Shard,
    cfg: Config,
    plan: StepPlan,
    progress: Progress,
    collate: Collate,
    waited: DataWait,
    device: torch.device,
    place: tuple[int, int],
) -> Iterator[StepGroup]:
    """The steps from the progress's data position on, epoch after epoch until the plan's steps are done. The caller
    moves `progress.step` and `batches_in_epoch`; the epoch rolls over here. A fixed-size run's steps are its own
    shard's micro-batches, `gradient_accumulation_steps` at a time (the epoch's last group may be short); an elastic
    run's are this rank's part of the next `plan.global_micro_per_step` of the global stream. `place`: this
    worker's rank and the group's size."""
    rank, world_size = place
    accum = plan.accumulation(world_size, cfg.train.gradient_accumulation_steps)
    while progress.step < plan.total_steps:
        skip = progress.batches_in_epoch
        if plan.global_micro_per_step:  # every rank reads the whole stream: collate only the batches it keeps
            from rayft.data.pipeline import AsRead  # here: Ray Data, which timing a step alone never needs

            batches = enumerate(waited(epoch_batches(shard, cfg, plan, progress.epoch, skip, AsRead())), skip)
            key = (cfg.train.seed, progress.epoch)
            part = Part(plan.global_micro_per_step, accum * rank, accum)
            yield from _my_part(batches, collate, part, key, device)
        else:
            batches = enumerate(waited(epoch_batches(shard, cfg, plan, progress.epoch, skip, collate)), skip)
            group = StepGroup()
            for micro, batch in batches:
                group.batches.append(to_device(batch, device))
                if len(group.batches) == min(accum, plan.micro_batches_per_epoch - (micro - micro % accum)):
                    group.last = micro
                    yield group
                    group = StepGroup()
        progress.epoch += 1
        progress.batches_in_epoch = 0


@dataclass(frozen=True)
class Part:
    """A rank's micro-batches in each step of the global stream: `count` of every `per_step`, from `first` on."""

    per_step: int
    first: int
    count: int

    def holds(self, index: int) -> bool:
        return self.first <= index % self.per_step < self.first + self.count


def _my_part(
    batches: Iterator[tuple[int, Any]], collate: Collate, part: Part, key: tuple[int, int], device: torch.device
) -> Iterator[StepGroup]:
    """This rank's `part` of each global step's micro-batches, collated, each with a seed drawn from its global
    index: dropout masks then follow the micro-batch, not the rank that happens to train it, so a step's result
    does not depend on the group's size."""
    group = StepGroup(seeds=[])
    for index, batch in batches:
        if part.holds(index):
            group.batches.append(to_device(collate(batch), device))
            assert group.seeds is not None  # every group here is made with seeds
            group.seeds.append(int(np.random.SeedSequence([*key, index]).generate_state(1)[0]))
        if index % part.per_step == part.per_step - 1:
            group.last = index
            yield group
            group = StepGroup(seeds=[])


def epoch_batches(shard: Shard, cfg: Config, plan: StepPlan, epoch: int, skip: int, collate: Collate) -> Iterator[Any]:
    """One epoch of this rank's micro-batches (an elastic run's: the whole stream's), reshuffled per epoch (seeded,
    so a rerun sees the same order).

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


@dataclass
class GlobalPart:
    """A rank's contiguous part of the first `batches` batches of a stream every rank reads whole (an elastic run's
    validation split): every group size then scores the same records, each rank as many batches."""

    stream: Any  # the rank's view of the whole split, iterated as Ray Data's `DataIterator`
    batches: int
    rank: int
    world_size: int

    def iter_torch_batches(self, *, batch_size: int, collate_fn: Collate, **options: Any) -> Iterator[Any]:
        per_rank = self.batches // self.world_size
        batches = self.stream.iter_torch_batches(batch_size=batch_size, collate_fn=collate_fn, **options)
        return islice(batches, self.rank * per_rank, (self.rank + 1) * per_rank)


class DataWait:
    """Seconds the loop spent waiting for its next batch since the last `take()`. The wait for the very first
    batch is the pipeline's start-up, kept apart until `take_first()`."""

    def __init__(self) -> None:
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
